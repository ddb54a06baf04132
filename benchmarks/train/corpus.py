"""The training corpus: four domains of permissively licensed text found offline on
every machine of this kind (the Python interpreter's standard library, C headers,
OpenSSL's manual pages, cloud API descriptions in JSON and YAML).

Every file is listed in the manifest with its size, SHA-256, licence and split, so a
run elsewhere can tell whether it trained on the same bytes. Files are split between
train and validation by a hash of their path (about one in twenty held out), so a
domain's validation text is never seen in training.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import subprocess
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path

VALID_EVERY = 20  # one file in twenty (by path hash) is held out
MAX_FILE_BYTES = 256 * 1024  # larger files are generated tables, not text a model should learn
DOC_SEPARATOR = "<|endoftext|>"

_PURELIB = Path(sysconfig.get_paths()["purelib"])
_STDLIB = Path(sysconfig.get_paths()["stdlib"])
_INCLUDE = Path(sysconfig.get_paths()["include"])
# the interpreter's own site-packages (a venv's purelib holds only what the venv installed)
_BASE_SITE = _STDLIB / "site-packages"


@dataclass(frozen=True)
class Source:
    """Files of one licence feeding one domain."""

    domain: str
    license: str
    root: Path
    patterns: tuple[str, ...]
    # a file is used only if this text is in its first 2 KiB (the licence header)
    header_must_contain: str | None = None
    render: str = "text"  # "text", "man" (rendered with man -l), "pydoc-topics"

    def files(self) -> list[Path]:
        if not self.root.exists():
            return []
        if self.root.is_file():
            return [self.root]
        found = set()
        for pattern in self.patterns:
            found.update(p for p in self.root.glob(pattern) if p.is_file() and not p.is_symlink())
        skip = ("/test/", "/tests/", "/idle_test/", "/__pycache__/")
        return sorted(p for p in found if not any(s in str(p) + "/" for s in skip))


def sources() -> list[Source]:
    numpy_include = _BASE_SITE / "numpy" / "_core" / "include"
    return [
        Source("python", "PSF-2.0", _STDLIB, ("*.py", "*/*.py", "*/*/*.py")),
        Source("c", "PSF-2.0", _INCLUDE, ("*.h", "*/*.h")),
        Source("c", "BSD-3-Clause", numpy_include, ("**/*.h",)),
        Source("c", "Apache-2.0", Path("/usr/include/openssl"), ("*.h",)),
        Source("c", "MIT", Path("/usr/include/X11"), ("*.h", "*/*.h")),
        Source("c", "MIT", Path("/usr/include/GL"), ("*.h",)),
        Source("c", "Zlib", Path("/usr/include/zlib.h"), ()),
        Source("prose", "PSF-2.0", _STDLIB / "pydoc_data" / "topics.py", (), render="pydoc-topics"),
        Source("prose", "Apache-2.0", Path("/usr/share/man"), ("man*/*ssl.gz",), render="man"),
        Source("data", "Apache-2.0", _BASE_SITE / "botocore" / "data", ("*/*/paginators-1.json", "*/*/waiters-2.json",
                                                                         "*/*/examples-1.json", "*.json")),
        Source("data", "Apache-2.0", Path("/usr/lib/google-cloud-sdk/lib"), ("**/*.yaml",),
               header_must_contain="Licensed under the Apache License"),
    ]


DOMAINS = ("python", "c", "prose", "data")


def _render(path: Path, how: str) -> str | None:
    if how == "man":
        env = dict(os.environ, MANWIDTH="80", LC_ALL="C.UTF-8")
        out = subprocess.run(["man", "-l", str(path)], capture_output=True, env=env, timeout=60)
        if out.returncode != 0:
            return None
        plain = subprocess.run(["col", "-bx"], input=out.stdout, capture_output=True, timeout=60).stdout
        return plain.decode("utf-8", "replace")
    if how == "pydoc-topics":
        namespace: dict = {}
        exec(compile(path.read_text(encoding="utf-8"), str(path), "exec"), namespace)  # the stdlib's own file
        topics = namespace["topics"]
        return "\n\n".join(topics[k] for k in sorted(topics))
    raw = path.read_bytes()
    if path.suffix == ".gz":
        raw = gzip.decompress(raw)
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return None


def _split(relpath: str) -> str:
    h = int.from_bytes(hashlib.sha256(relpath.encode()).digest()[:4], "little")
    return "valid" if h % VALID_EVERY == 0 else "train"


def build(out_dir: Path, *, log=print) -> dict:
    """Write ``{domain}.{train,valid}.txt`` and ``manifest.json`` under ``out_dir``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    texts: dict[tuple[str, str], list[str]] = {(d, s): [] for d in DOMAINS for s in ("train", "valid")}
    manifest_files = []
    for source in sources():
        files = source.files()
        if not files:
            log(f"corpus: {source.root} is missing on this machine (domain {source.domain})")
        for path in files:
            if source.render == "text" and path.stat().st_size > MAX_FILE_BYTES:
                continue
            raw = path.read_bytes()
            if source.header_must_contain and source.header_must_contain.encode() not in raw[:2048]:
                continue
            text = _render(path, source.render)
            if text is None or not text.strip() or DOC_SEPARATOR in text:
                continue
            if source.render == "pydoc-topics":
                # one long file: hold out every twentieth topic paragraph block instead of the file
                blocks = text.split("\n\n")
                train = "\n\n".join(b for i, b in enumerate(blocks) if i % VALID_EVERY)
                valid = "\n\n".join(b for i, b in enumerate(blocks) if not i % VALID_EVERY)
                texts[(source.domain, "train")].append(train)
                texts[(source.domain, "valid")].append(valid)
                split = "both"
            else:
                split = _split(str(path))
                texts[(source.domain, split)].append(text)
            manifest_files.append({
                "path": str(path), "domain": source.domain, "license": source.license, "split": split,
                "bytes": len(raw), "sha256": hashlib.sha256(raw).hexdigest(),
            })
    summary = {}
    for (domain, split), docs in texts.items():
        body = ("\n" + DOC_SEPARATOR + "\n").join(docs)
        target = out_dir / f"{domain}.{split}.txt"
        tmp = target.with_suffix(".tmp")
        tmp.write_text(body, encoding="utf-8")
        os.replace(tmp, target)
        summary[f"{domain}.{split}"] = {"documents": len(docs), "characters": len(body)}
    manifest = {
        "python": sys.version.split()[0],
        "valid_every": VALID_EVERY,
        "max_file_bytes": MAX_FILE_BYTES,
        "splits": summary,
        "files": manifest_files,
        "sha256": hashlib.sha256(json.dumps(manifest_files, sort_keys=True).encode()).hexdigest(),
    }
    tmp = out_dir / "manifest.json.tmp"
    tmp.write_text(json.dumps(manifest, indent=1))
    os.replace(tmp, out_dir / "manifest.json")
    for key, s in summary.items():
        log(f"corpus: {key}: {s['documents']} documents, {s['characters'] / 1e6:.2f} M characters")
    return manifest


if __name__ == "__main__":
    build(Path(sys.argv[1]))
