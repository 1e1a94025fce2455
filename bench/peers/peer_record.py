"""Result records for peer runs, in the format ``kvserve bench plot`` reads (stdlib only).

Imported by the peer scripts, which may run in a peer's own venv without kvserve installed.
"""

from __future__ import annotations

import json
import platform
from pathlib import Path
from typing import Any


def load_prompts(path: str, num: int | None = None) -> list[tuple[list[int], int]]:
    """(prompt token ids, output length) of the first ``num`` requests of a resolved trace."""
    out = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            if line.strip():
                d = json.loads(line)
                if "prompt_token_ids" not in d:
                    raise ValueError(
                        f"{path}: write it with `kvserve bench workload` (ids resolved)"
                    )
                out.append((d["prompt_token_ids"], int(d["output_len"])))
    return out[:num]


def throughput_record(
    system: str,
    version: str,
    batch_size: int,
    num_prompt: int,
    num_output: int,
    elapsed_s: float,
    num_requests: int,
    **extra: Any,
) -> dict[str, Any]:
    """An offline throughput record for ``batch_size`` requests run together."""
    return {
        "benchmark": "throughput",
        "system": system,
        "version": version,
        "mode": "offline",
        "python": platform.python_version(),
        "batch_size": batch_size,
        "results": {
            "num_requests": num_requests,
            "num_prompt_tokens": num_prompt,
            "num_output_tokens": num_output,
            "elapsed_s": elapsed_s,
            "requests_per_s": num_requests / elapsed_s,
            "output_tokens_per_s": num_output / elapsed_s,
            "total_tokens_per_s": (num_prompt + num_output) / elapsed_s,
            **extra,
        },
    }


def write(record: dict[str, Any], out_dir: str, name: str) -> str:
    """Write ``record`` as ``out_dir/name.json``; returns the path."""
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    path = Path(out_dir) / f"{name}.json"
    path.write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
    r = record["results"]
    print(
        f"{record['system']:>12} B={record.get('batch_size')}: "
        f"{r['output_tokens_per_s']:.1f} generated tok/s ({r['elapsed_s']:.1f} s) -> {path}",
        flush=True,
    )
    return str(path)
