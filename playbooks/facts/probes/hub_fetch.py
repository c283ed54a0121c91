#!/usr/bin/env python3
"""voltaforge hub fetch: run on the host by the toolchain venv's python (huggingface_hub).

    hub_fetch.py REPO REVISION DEST

Resolves REVISION to its commit sha, downloads only what a conversion needs (config and
tokenizer files, safetensors shards) at that sha into DEST (resumable: huggingface_hub keeps
partial downloads in DEST/.cache), then checks every LFS file against the sha256 the hub
publishes for it. The token, when one is needed, comes from the file HF_TOKEN_PATH names
(huggingface_hub reads it itself): never from argv, never printed.

Prints exactly ONE line of JSON and exits 0 whatever happens:
    {"probe": "voltaforge-hub-fetch", "sha": "...", "files": {"name": {"bytes": n, "sha256": "..."}}}
    {"probe": "voltaforge-hub-fetch", "error": "revision-not-found" | "gated" | "repo-not-found" |
     "unreachable" | "corrupt" | "other", "message": "..."}
Python 3.8 compatible.
"""

import hashlib
import json
import os
import sys

PATTERNS = ["*.json", "*.safetensors", "tokenizer.model", "*.tiktoken", "merges.txt", "vocab.txt"]


def _sha256(path):
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def fetch(repo, revision, dest):
    # a recipe may name the token file from the SSH user's home (~/...): expanded here, on the host
    if os.environ.get("HF_TOKEN_PATH"):
        os.environ["HF_TOKEN_PATH"] = os.path.expanduser(os.environ["HF_TOKEN_PATH"])
    from huggingface_hub import HfApi, snapshot_download

    info = HfApi().model_info(repo, revision=revision, files_metadata=True)
    published = {}
    for s in info.siblings or []:
        lfs = getattr(s, "lfs", None)
        if lfs is not None:
            published[s.rfilename] = getattr(lfs, "sha256", None) or (
                lfs.get("sha256") if isinstance(lfs, dict) else None
            )
    snapshot_download(repo, revision=info.sha, local_dir=dest, allow_patterns=PATTERNS)
    files = {}
    for name in sorted(os.listdir(dest)):
        path = os.path.join(dest, name)
        if not os.path.isfile(path) or name.startswith("."):
            continue
        digest = _sha256(path)
        want = published.get(name)
        if want and want != digest:
            return {
                "error": "corrupt",
                "message": f"{name}: sha256 {digest[:12]}, the hub publishes {want[:12]}",
            }
        files[name] = {"bytes": os.path.getsize(path), "sha256": digest}
    return {"sha": info.sha, "files": files}


def classify(exc):
    name = type(exc).__name__
    kinds = {
        "RevisionNotFoundError": "revision-not-found",
        "GatedRepoError": "gated",
        "RepositoryNotFoundError": "repo-not-found",
        "LocalEntryNotFoundError": "unreachable",
        "ConnectionError": "unreachable",
        "ConnectTimeout": "unreachable",
        "ReadTimeout": "unreachable",
        "OfflineModeIsEnabled": "unreachable",
    }
    for klass in type(exc).__mro__:
        if klass.__name__ in kinds:
            return kinds[klass.__name__]
    return "other" if name not in kinds else kinds[name]


def main(argv):
    result = {"probe": "voltaforge-hub-fetch", "probe_version": 1}
    if len(argv) != 3:
        result.update(error="other", message="usage: hub_fetch.py REPO REVISION DEST")
    else:
        try:
            result.update(fetch(*argv))
        except Exception as exc:  # noqa: BLE001 - reported as JSON, never raised
            text = str(exc).strip().splitlines()
            result.update(error=classify(exc), message="{}: {}".format(type(exc).__name__, text[0] if text else ""))
    sys.stdout.write(json.dumps(result) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
