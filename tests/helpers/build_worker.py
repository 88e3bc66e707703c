"""Builds a cache from a folder of toy images with a slow encoder, committing after every batch.

Used by the kill tests: ``python build_worker.py SOURCE CACHE [SLEEP_S]``. Prints ``progress D/T`` lines.
"""

import sys

import streaming_cache as sc
from streaming_cache.devtools.toy import folder_items, toy_encoders


def build(src: str, cache: str, sleep_s: float = 0.0, **kwargs):
    return sc.build(cache, folder_items(src), toy_encoders(batch_size=4, sleep_s=sleep_s), commit_seconds=0,
                    **kwargs)


if __name__ == "__main__":
    src, cache = sys.argv[1], sys.argv[2]
    sleep_s = float(sys.argv[3]) if len(sys.argv) > 3 else 0.005
    build(src, cache, sleep_s, progress=lambda d, t: print(f"progress {d}/{t}", flush=True))
    print("done", flush=True)
