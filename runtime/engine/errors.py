"""The root of every refusal the device side makes about what it is given."""


class RefusedInput(ValueError):
    """A model, engine, adapter or package the runtime will not run; the message says why."""
