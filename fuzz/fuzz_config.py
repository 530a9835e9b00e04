"""Fuzz the config loader: a model's config.json (the DeepSeek preset, a tiny config, the
HF `text_config` nesting; JSON values swapped, bytes edited, the file replaced by a
directory, FIFO, symlink, ...) read through `EngramConfig.from_pretrained`, `from_file`
and `resolve` (what every `--config`/`--model` option takes), preset names through
`from_preset`, then the prime layout every consumer builds from a config.

Beyond the rule (fuzz/fuzz_common.py), a config that loads must survive its own round trip
(same fields, same fingerprint) and give a layout of one positive row count per layer.

    python -m fuzz.fuzz_config -runs=2000 -seed=1 NEW_DIR fuzz/corpus/config
"""

from __future__ import annotations

import json
from pathlib import Path

import atheris

from fuzz.fuzz_common import RuleBroken, Scratch, dump_json, edit_bytes, edit_json, fuzz_main, instrumented, keep_rule, pick_kind, place  # isort: skip (one line)

with instrumented():
    from engram_sglang.core.config import EngramConfig, configs_dir
    from engram_sglang.core.hashing import EngramLayout

_PRESET = json.loads((configs_dir() / "deepseek-v4.1-flash.json").read_text())
_TINY = {"engram_layer_ids": [0, 2], "engram_max_ngram_size": 2, "engram_n_heads": 2, "engram_head_dim": 256,
         "engram_vocab_size": 3, "engram_compressed_vocab_size": 3, "engram_pad_token_id": 0, "hidden_size": 64}
BASELINES = (
    _PRESET,
    _TINY,
    {"architectures": ["DeepseekV41ForCausalLM"], "model_type": "deepseek_v41",
     "text_config": {**_TINY, "engram_num_embeddings": [8, 18], "hc_mult": 4}},
)
KEYS = tuple(_PRESET) + ("text_config", "engram_num_embeddings", "hc_mult", "hidden_size")
PRESET_NAMES = ("deepseek-v4.1-flash", "gpus", "models/deepseek_v41", "recipes/deepseek-v4.1-flash-h100",
                "../configs/deepseek-v4.1-flash", "nope", "", ".", "..")

scratch = Scratch("config")


def make_config(fdp: atheris.FuzzedDataProvider, root: Path) -> Path:
    """The model directory an input describes, at root/model, holding config.json."""
    model = root / "model"
    doc = json.loads(json.dumps(fdp.PickValueInList(list(BASELINES))))
    mode = fdp.ConsumeIntInRange(0, 3)
    if mode == 3:  # any text at all
        data = fdp.ConsumeBytes(fdp.ConsumeIntInRange(0, 4096))
    else:
        data = dump_json(edit_json(doc, fdp, KEYS, max_edits=4)) if mode in (0, 2) else dump_json(doc)
        if mode in (1, 2):
            data = edit_bytes(data, fdp)
    place(model / "config.json", data, pick_kind(fdp), root / "outside")
    model.mkdir(exist_ok=True)
    return model


def check_loaded(cfg: EngramConfig, names) -> None:
    """What a config that loads must be."""
    again = EngramConfig.from_dict({**cfg.hash_fields(), "hidden_size": cfg.hidden_size, "hc_mult": cfg.hc_mult})
    if again != cfg or again.fingerprint() != cfg.fingerprint():
        raise RuleBroken(f"{cfg.source}: loads as {cfg}, but its own fields load as {again}")
    layout, err = keep_rule(lambda: EngramLayout(cfg), names)
    if err is None and (len(layout.num_embeddings) != cfg.n_layers or min(layout.num_embeddings) < 1):
        raise RuleBroken(f"{cfg.source}: layout rows {layout.num_embeddings} for layers {cfg.layer_ids}")


def test_one_input(data: bytes) -> None:
    fdp = atheris.FuzzedDataProvider(data)
    model = make_config(fdp, scratch.fresh())
    path = model / "config.json"
    how = fdp.ConsumeIntInRange(0, 3)
    if how == 0:
        load, names = (lambda: EngramConfig.from_pretrained(model)), [model]
    elif how == 1:
        load, names = (lambda: EngramConfig.from_file(path)), [path]
    elif how == 2:
        spec = str(fdp.PickValueInList([model, path]))
        load, names = (lambda: EngramConfig.resolve(spec)), [spec]
    else:
        name = fdp.PickValueInList(list(PRESET_NAMES)) if fdp.ConsumeBool() else fdp.ConsumeUnicodeNoSurrogates(24).replace("\0", "")
        load, names = (lambda: EngramConfig.resolve(name)), [repr(name)[1:-1], name, str(Path(name))]
    cfg, err = keep_rule(load, names)
    if err is None:
        check_loaded(cfg, [cfg.source])


if __name__ == "__main__":
    fuzz_main(test_one_input)
