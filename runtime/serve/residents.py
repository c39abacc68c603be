"""The releases resident on a device, their channels, and which one a request gets.

A device holds up to ``max_resident`` verified releases at once, each bound to its own engine handle
(``runtime.serve.active_release.ActiveRelease``). Two channels name one release each:

- ``champion``: what a request without ``model`` gets; loading a release as champion is a swap, and
  it is refused when older than the champion (``RollbackRefused``) unless rollback is allowed (a
  local act, never the network's).
- ``candidate``: a release on trial; a share of requests without ``model`` may go to it
  (``CanarySplit``). It is never older than the champion: it is refused when it would be, and a
  champion newer than the candidate takes the candidate's channel away.

Every other resident release is ``standby`` (a champion or candidate that was replaced), still
served to requests that name it by release id or month, until the least recently used of them is
unloaded to make room (``lru``) or an admin unloads it (``admin``). Unloading only forgets the
release: requests already running on it hold their ``ActiveRelease`` and finish on it.

**Products.** A device serves the products it is configured for (``products``, the first its default), each
a line of releases (the signed manifest's ``product``) with a champion and a candidate of its own; rollback
order is compared within a product. A request's ``model`` (``find``) is one of:

- ``<product>``: that product's champion; ``<product>:champion``, ``<product>:candidate`` its channels;
- ``champion``, ``candidate``: the default product's channels (what a single-product device always had);
- a release id; ``<product>:<release id>``;
- a month ``YYYY-MM``: of the default product when it has a release of that month, else of the one product
  that has (several: ``ambiguous_model``); ``<product>:<month>``. Within a product, the channel holder of
  that month first, else its newest release.
"""

from __future__ import annotations

import math
import threading
from collections import OrderedDict
from fractions import Fraction

from runtime.engine.errors import RefusedInput
from runtime.release.contract import DEFAULT_PRODUCT, check_product, release_order
from runtime.release.verify import RollbackRefused
from runtime.serve.active_release import ActiveRelease

CHAMPION, CANDIDATE, STANDBY = "champion", "candidate", "standby"
CHANNELS = (CHAMPION, CANDIDATE)  # what a release can be loaded as; STANDBY is what a replaced one becomes
DEFAULT_MAX_RESIDENT = 3  # the champion, a candidate, and the previous champion for clients pinned to it
UNLOAD_REASONS = ("lru", "admin")


class ResidencyError(RefusedInput):
    """A change of the resident set that cannot be made in its current state; ``code`` says which
    (the CLI exits 2 on it: ``serve --candidate`` naming the ``--package`` release)."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code


class ResidentSet:
    """Resident releases by release id, least recently used first, and the channel each holds in its product;
    thread-safe. ``products``: the products this device serves, the first its default."""

    def __init__(self, max_resident: int = DEFAULT_MAX_RESIDENT, products: tuple[str, ...] = (DEFAULT_PRODUCT,)):
        if max_resident < len(CHANNELS):
            raise ValueError(f"max_resident {max_resident}: at least {len(CHANNELS)}, the champion and a candidate")
        if not products or len(set(products)) != len(products):
            raise ValueError(f"products {list(products)}: one or more, each once")
        self.max_resident = max_resident
        self.products = tuple(check_product(p) for p in products)
        self.default_product = self.products[0]
        self._releases: OrderedDict[str, ActiveRelease] = OrderedDict()
        self._channels: dict[tuple[str, str], str] = {}  # (product, channel) -> release id
        self._lock = threading.Lock()

    @property
    def champion(self) -> ActiveRelease | None:
        """The default product's champion."""
        return self.holder(CHAMPION)

    @property
    def candidate(self) -> ActiveRelease | None:
        """The default product's candidate."""
        return self.holder(CANDIDATE)

    def holder(self, channel: str, product: str | None = None) -> ActiveRelease | None:
        """What ``channel`` of ``product`` (default: the device's default product) holds, or None."""
        with self._lock:
            release_id = self._channels.get((product or self.default_product, channel))
            return None if release_id is None else self._releases[release_id]

    def channel_of(self, release: ActiveRelease) -> str:
        """The channel ``release`` holds now in its product (STANDBY also once it is unloaded)."""
        with self._lock:
            return next((c for (_, c), r in self._channels.items() if r == release.release_id
                         and self._releases[r] is release), STANDBY)

    def listing(self) -> list[tuple[ActiveRelease, str]]:
        """(release, channel) of every resident release: the champions, the candidates, then standby ones, most
        recently used first."""
        with self._lock:
            channel = {r: c for (_, c), r in self._channels.items()}
            pairs = [(r, channel.get(r.release_id, STANDBY)) for r in reversed(self._releases.values())]
        return sorted(pairs, key=lambda pair: (CHANNELS + (STANDBY,)).index(pair[1]))  # stable: recency kept

    def find(self, model: str) -> ActiveRelease | None:
        """The resident release ``model`` names (module docstring), marked as used; None if none. Raises
        ResidencyError (``ambiguous_model``) for a month several products other than the default have."""
        with self._lock:
            release_id = self._resolve(model)
            if release_id is None:
                return None
            self._releases.move_to_end(release_id)
            return self._releases[release_id]

    def _resolve(self, model: str) -> str | None:
        """The release id ``model`` names (lock held)."""
        product, scoped, name = model.rpartition(":")
        if not scoped and model in self.products:
            return self._channels.get((model, CHAMPION))
        if scoped and product not in self.products:
            return None
        if name in CHANNELS:
            return self._channels.get((product or self.default_product, name))
        if name in self._releases and (not scoped or self._releases[name].product == product):
            return name
        of_month = [r for r in self._releases.values() if r.manifest["month"] == name and (not scoped or r.product == product)]
        if not scoped and len({r.product for r in of_month}) > 1:
            own = [r for r in of_month if r.product == self.default_product]
            if not own:
                raise ResidencyError("ambiguous_model", f"model {model!r}: products {sorted({r.product for r in of_month})} "
                                     f"have releases of {name}; name one as <product>:{name}")
            of_month = own
        held = [r for r in of_month if r.release_id in self._channels.values()]
        if not (held or of_month):
            return None
        return max(held or of_month, key=lambda r: release_order(r.release_id)).release_id

    def add(self, release: ActiveRelease, channel: str, allow_rollback: bool) -> list[ActiveRelease]:
        """Make ``release`` resident on ``channel`` of its product; the releases unloaded to make room, least
        recently used first. Raises RollbackRefused or ResidencyError, changing nothing."""
        if channel not in CHANNELS:
            raise ValueError(f"channel {channel!r}: one of {', '.join(CHANNELS)}")
        order = release_order(release.release_id)
        product = release.product
        if product not in self.products:
            raise ResidencyError("unknown_product", f"release {release.release_id} is of product {product}, which this "
                                 f"device does not serve (products: {', '.join(self.products)}; --product)")
        with self._lock:
            same_id = self._releases.get(release.release_id)
            if same_id is not None and same_id.product != product:
                raise ResidencyError("release_id_taken", f"release {release.release_id} of product {product}: a release "
                                     f"of product {same_id.product} with that id is resident; unload it first")
            champion = self._releases.get(self._channels.get((product, CHAMPION), ""))
            if champion is not None and order < release_order(champion.release_id) and not allow_rollback:
                raise RollbackRefused(f"release {release.release_id} is older than the champion {champion.release_id}, "
                                      "which was activated while this one was being verified")
            if channel == CANDIDATE and champion is None:
                raise ResidencyError("no_champion", f"candidate {release.release_id}: there is no champion to "
                                     "compare it with yet; load a champion first")
            if channel == CANDIDATE and champion.release_id == release.release_id:
                raise ResidencyError("is_champion", f"{release.release_id} is the champion already")
            if self._channels.get((product, CANDIDATE)) == release.release_id:
                del self._channels[product, CANDIDATE]  # a release holds one channel: loaded as champion, no longer candidate
            self._channels[product, channel] = release.release_id
            candidate = self._releases.get(self._channels.get((product, CANDIDATE), ""))
            if channel == CHAMPION and candidate is not None and release_order(candidate.release_id) < order:
                del self._channels[product, CANDIDATE]  # the candidate is never older than the champion
            self._releases[release.release_id] = release
            self._releases.move_to_end(release.release_id)
            return self._evict()

    def _evict(self) -> list[ActiveRelease]:
        """Unload standby releases, least recently used first, down to ``max_resident`` (lock held)."""
        held = set(self._channels.values())
        evicted = []
        for release_id in list(self._releases):
            if len(self._releases) <= self.max_resident:
                break
            if release_id not in held:
                evicted.append(self._releases.pop(release_id))
        return evicted

    def promote(self, product: str | None = None) -> tuple[ActiveRelease, ActiveRelease]:
        """``product``'s (default: the device's default product) candidate becomes its champion, the champion goes
        to standby: (new champion, old champion)."""
        product = product or self.default_product
        with self._lock:
            if (product, CANDIDATE) not in self._channels:
                raise ResidencyError("no_candidate", f"product {product} has no candidate to promote (load one with "
                                     "channel candidate)")
            old, new = self._releases[self._channels[product, CHAMPION]], self._releases[self._channels[product, CANDIDATE]]
            if release_order(new.release_id) < release_order(old.release_id):  # a candidate loaded locally with rollback
                raise RollbackRefused(f"candidate {new.release_id} is older than the champion {old.release_id}: "
                                      "promoting it is a rollback, a local act")
            self._channels[product, CHAMPION] = self._channels.pop((product, CANDIDATE))
            return self._releases[self._channels[product, CHAMPION]], old

    def remove(self, model: str) -> ActiveRelease:
        """Unload the release ``model`` names (a candidate loses its channel); never a champion."""
        release = self.find(model)
        with self._lock:
            if release is None or self._releases.get(release.release_id) is not release:
                raise ResidencyError("model_not_found", f"model {model!r} is not resident here")
            if self._channels.get((release.product, CHAMPION)) == release.release_id:
                raise ResidencyError("champion", f"{release.release_id} is the champion: load or promote another "
                                     "champion first")
            if self._channels.get((release.product, CANDIDATE)) == release.release_id:
                del self._channels[release.product, CANDIDATE]
            return self._releases.pop(release.release_id)


class CanarySplit:
    """Which requests without ``model`` go to the candidate: exactly ``floor(n * share)`` of the first ``n``
    since the candidate was loaded, spread evenly (request n goes when ``floor(n * share)`` steps up), so any
    window of ``k`` requests holds ``floor(k * share)`` or one more. The share is exact as written
    (``Fraction("0.1")`` is 1/10): no float drift over a long run, and no coin flips to make tests flaky.
    A request takes its turn when its release is picked, so one the queue then refuses (503) still counted."""

    def __init__(self, share: float):
        if not 0 <= share <= 1:
            raise ValueError(f"canary share {share}: a fraction from 0 to 1")
        self.share = Fraction(str(share))
        self._candidate: str | None = None
        self._n = 0  # requests without model since this candidate
        self._lock = threading.Lock()

    def to_candidate(self, candidate_id: str) -> bool:
        """Whether the next request without ``model`` goes to the candidate ``candidate_id``."""
        with self._lock:
            if candidate_id != self._candidate:  # a new candidate starts a new window
                self._candidate, self._n = candidate_id, 0
            self._n += 1
            return math.floor(self._n * self.share) > math.floor((self._n - 1) * self.share)
