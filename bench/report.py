"""What every benchmark does last: write its JSON payload and say where."""

from __future__ import annotations

import json
from pathlib import Path


def write_report(out: Path, payload: dict) -> None:
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(payload, indent=2, sort_keys=True) + "\n")
    print(f"\nwrote {out}")
