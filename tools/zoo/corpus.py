"""Build the zoo's training corpus: this interpreter's own standard-library `.py` sources, split by path hash."""

from __future__ import annotations

import argparse
import hashlib
import json
import platform
import sys
import sysconfig
from pathlib import Path

# One file in twenty goes to held-out; a hash of the path (not a random draw) keeps the split stable.
HELDOUT_MODULUS = 20


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def is_heldout(rel: str) -> bool:
    digest = hashlib.sha256(rel.encode("utf-8")).hexdigest()
    return int(digest[:8], 16) % HELDOUT_MODULUS == 0


def collect(root: Path) -> tuple[list[dict], list[str]]:
    """Every stdlib .py file outside site-packages, sorted by relative path; undecodable files are listed apart."""
    files, skipped = [], []
    paths = sorted(
        (p for p in root.rglob("*.py") if "site-packages" not in p.relative_to(root).parts),
        key=lambda p: p.relative_to(root).as_posix(),
    )
    for path in paths:
        rel = path.relative_to(root).as_posix()
        data = path.read_bytes()
        try:
            data.decode("utf-8")
        except UnicodeDecodeError:
            # A handful of encoding tests are latin-1 / koi8-r on purpose; the tokenizer takes str.
            skipped.append(rel)
            continue
        files.append({"path": rel, "bytes": len(data), "split": "heldout" if is_heldout(rel) else "train"})
    return files, skipped


def load_manifest(path: Path) -> dict:
    return json.loads(path.read_text())


def read_split(manifest: dict, split: str) -> list[str]:
    """The texts of one split, in manifest (sorted path) order."""
    root = Path(manifest["stdlib"])
    if manifest["python"] != platform.python_version():
        # Another interpreter has another stdlib: the token counts and split would silently change.
        raise SystemExit(f"manifest was built with Python {manifest['python']}, this is {platform.python_version()}")
    return [(root / f["path"]).read_text(encoding="utf-8") for f in manifest["files"] if f["split"] == split]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", type=Path, default=Path(".zoo/corpus.json"))
    args = ap.parse_args()
    root = stdlib_root()
    files, skipped = collect(root)
    counts = {s: sum(1 for f in files if f["split"] == s) for s in ("train", "heldout")}
    nbytes = {s: sum(f["bytes"] for f in files if f["split"] == s) for s in ("train", "heldout")}
    manifest = {
        "python": platform.python_version(),
        "implementation": sys.implementation.name,
        "stdlib": str(root),
        "heldout_rule": f"int(sha256(relative_path)[:8], 16) % {HELDOUT_MODULUS} == 0",
        "file_counts": counts,
        "byte_counts": nbytes,
        "skipped_not_utf8": skipped,
        "files": files,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(manifest, indent=1))
    print(f"Python {manifest['python']}: {counts} files, {nbytes} bytes, {len(skipped)} skipped -> {args.out}")


if __name__ == "__main__":
    main()
