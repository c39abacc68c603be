"""``ActiveRelease``: a verified release bound to its own engine handle, as ``AdapterServer.load`` makes it.

Its own module, below the server (``runtime.serve.server``), the resident set (``runtime.serve.residents``)
and the health gate (``runtime.serve.health``), which all hold releases: none of them imports another for it.
"""

from __future__ import annotations

from dataclasses import dataclass

from runtime.release.contract import manifest_product


@dataclass(frozen=True)
class ActiveRelease:
    release_id: str
    activation: int  # 1 for the first release loaded, +1 per load (either channel)
    manifest: dict
    handle: object  # an engine handle with this release bound; forked per batch or request, never rebound
    loaded_at: float

    @property
    def product(self) -> str:
        return manifest_product(self.manifest)
