"""Teacher-forced log-likelihood of token sequences in an Engram mode: from a running SGLang
server (its input logprobs), or from the reference forward (exact float32 logits, no server).

A mode is what a request's `sampling_params.custom_params["engram"]` holds
(serving/modes.py): "on", "off", or {"mode": "window", "from": A, "until": B}, Engram on at
positions A <= p < B. "on" is sent as no mode at all, so it works on any server; the others
need a server started with `--engram-ablation on`.

The server is asked for `max_new_tokens: 0`, `return_logprob`, `logprob_start_len: 0`:
SGLang 0.5.23 runs the prompt as one prefill and returns the log-probability of every
prompt token after the first (computed from the step's logits in the model's dtype, so
they differ from the reference's float32 in the low bits).
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Optional, Sequence

from ...core.errors import EngramError

Mode = Any  # "on" | "off" | {"mode": "window", "from": int, "until": int}


def window(start: int, until: int) -> dict:
    return {"mode": "window", "from": int(start), "until": int(until)}


class ServerScorer:
    """Input logprobs from SGLang's /generate at `url`, `concurrency` requests in flight
    (the server batches them)."""

    def __init__(self, url: str, concurrency: int = 8, timeout: float = 600):
        self.url, self.concurrency, self.timeout = url.rstrip("/"), concurrency, timeout

    def _post(self, body: dict) -> dict:
        req = urllib.request.Request(self.url + "/generate", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=self.timeout) as r:
                return json.loads(r.read())
        except urllib.error.HTTPError as e:
            text = " ".join(e.read().decode(errors="replace").split())[:300]
            hint = (" (modes other than on need a server started with --engram-ablation on)"
                    if "engram" in text and "ablation" in text else "")
            raise EngramError(f"{self.url}/generate: HTTP {e.code}: {text}{hint}") from None
        except (urllib.error.URLError, OSError) as e:
            raise EngramError(f"{self.url}: cannot reach the server ({getattr(e, 'reason', e)}); is it running?") from None

    def _one(self, item: tuple[Sequence[int], Mode]) -> list[float]:
        ids, mode = item
        params: dict = {"max_new_tokens": 0}
        if mode != "on":
            params["custom_params"] = {"engram": mode}
        out = self._post({"input_ids": list(ids), "sampling_params": params, "return_logprob": True,
                          "logprob_start_len": 0})
        got = out.get("meta_info", {}).get("input_token_logprobs")
        if not isinstance(got, list) or len(got) != len(ids) or [int(x[1]) for x in got] != list(ids):
            raise EngramError(f"{self.url}/generate: the input logprobs do not cover the {len(ids)} tokens sent "
                              f"(got {len(got) if isinstance(got, list) else got!r}); a server that ignores "
                              f"logprob_start_len?")
        return [float(x[0]) for x in got[1:]]

    def score(self, items: Sequence[tuple[Sequence[int], Mode]]) -> list[list[float]]:
        """Per (token ids, mode): the log-probability (nats) of tokens 1..T-1."""
        with ThreadPoolExecutor(max(1, self.concurrency)) as pool:
            return list(pool.map(self._one, items))


class ReferenceScorer:
    """The same from the reference forward (models/reference.py) with Engram on per position
    as the mode says (serving/modes.py `mask_for`)."""

    def __init__(self, model_dir, table_dir=None, reference=None):
        from pathlib import Path

        if reference is None:
            from ...core.config import DEFAULT_TABLE_DIR
            from ...models.reference import ReferenceModel

            reference = ReferenceModel(model_dir, table_dir or Path(model_dir) / DEFAULT_TABLE_DIR)
        self.reference = reference

    def _one(self, item: tuple[Sequence[int], Mode]) -> list[float]:
        import torch

        from ...serving.modes import mask_for, parse_mode

        ids, mode = item
        on: Optional[list[bool]] = None if mode == "on" else mask_for(parse_mode(mode), len(ids), len(ids))
        logits = self.reference.forward(ids, on).logits[:-1]
        target = torch.as_tensor(list(ids[1:])).unsqueeze(-1)
        return logits.log_softmax(-1).gather(-1, target).squeeze(-1).tolist()

    def score(self, items: Sequence[tuple[Sequence[int], Mode]]) -> list[list[float]]:
        return [self._one(item) for item in items]
