"""Out-of-range token ids fail their request, never the server (issue 22, item 1).

Where a request enters (the tokenizer manager: serving/request_check.py, through the hook of
plugin/tokenizer_manager.py) an id outside the model's vocabulary is a ValueError, SGLang's
HTTP 400, with one line naming the id and the vocabulary size. An id that reaches the forward
anyway fails only its request, as a failed table read does (EngramRuntime.refuse_unknown_tokens,
then serving/faults.py's abort). tests/e2e/test_e2e_serving.py sends such requests to a real server.
"""

from __future__ import annotations

from array import array
from types import SimpleNamespace

import pytest
import torch

from engram_sglang import plugin
from engram_sglang.serving.request_check import TokenIdError, check_token_ids, model_vocab_size

VOCAB = 1500


def tokenized(ids, **extra):
    """A stand-in for SGLang's TokenizedGenerateReqInput (ids as SGLang keeps them: array("q"))."""
    return SimpleNamespace(input_ids=None if ids is None else array("q", ids), mm_inputs=None, **extra)


@pytest.mark.parametrize("ids, bad", [([5, -1, 7], -1), ([5, VOCAB, 7], VOCAB), ([-3, 2, VOCAB + 9], -3),
                                      ([2**40], 2**40)])
def test_an_id_outside_the_vocabulary_is_one_line_naming_it_and_the_size(ids, bad):
    with pytest.raises(TokenIdError) as e:
        check_token_ids(tokenized(ids), VOCAB)
    assert isinstance(e.value, ValueError)  # SGLang's HTTP 400
    line = str(e.value)
    assert f"token id {bad} " in line and f"{VOCAB} tokens" in line and "\n" not in line, line


@pytest.mark.parametrize("ids", [[0], [VOCAB - 1], [0, 5, VOCAB - 1, 7], [], None])
def test_ids_inside_the_vocabulary_pass(ids):
    """The negative control: the edges 0 and vocab-1 are ids; no ids (input_embeds) is no id."""
    check_token_ids(tokenized(ids), VOCAB)
    check_token_ids(SimpleNamespace(input_ids=list(ids or ())), VOCAB)  # a plain list, no mm_inputs field


def test_without_a_vocabulary_size_or_for_multimodal_input_nothing_is_checked():
    check_token_ids(tokenized([-1]), None)
    check_token_ids(SimpleNamespace(input_ids=array("q", [VOCAB + 5]), mm_inputs=object()), VOCAB)


def test_the_vocabulary_size_is_the_model_config_s():
    assert model_vocab_size(SimpleNamespace(model_config=SimpleNamespace(vocab_size=VOCAB))) == VOCAB
    assert model_vocab_size(SimpleNamespace()) is None
    assert model_vocab_size(SimpleNamespace(model_config=SimpleNamespace(vocab_size=None))) is None


@pytest.mark.parametrize("mode", ["on", "off"])
def test_the_tokenizer_manager_hook_checks_every_request_whatever_the_mode(monkeypatch, mode):
    """The hook on a stand-in TokenizerManager: a bad id raises before the mode check (with
    --engram-mode off too, and for a request object without sampling params, as an embedding
    request), a good one goes through to the mode's prefix key."""
    from engram_sglang.plugin import tokenizer_manager
    from engram_sglang.serving.settings import ServeSettings

    monkeypatch.setattr(tokenizer_manager, "_settings", [ServeSettings(mode=mode)])

    class TokenizerManager:
        model_config = SimpleNamespace(vocab_size=VOCAB)

        def _create_tokenized_object(self, obj):
            return obj

        async def _handle_batch_request(self, obj):
            yield obj

    plugin.patch(SimpleNamespace(TokenizerManager=TokenizerManager), "sglang.srt.managers.tokenizer_manager")
    manager = TokenizerManager()
    params = SimpleNamespace(custom_params=None)
    for ids, bad in (([5, -1, 7], -1), ([5, VOCAB, 7], VOCAB)):
        with pytest.raises(ValueError, match=f"token id {bad} is outside the model's vocabulary of {VOCAB} tokens"):
            manager._create_tokenized_object(tokenized(ids, extra_key=None, sampling_params=params,
                                                       session_params=None))
        with pytest.raises(ValueError, match=f"token id {bad} "):
            manager._create_tokenized_object(tokenized(ids))
    ok = manager._create_tokenized_object(tokenized([5, VOCAB - 1, 7], extra_key=None, sampling_params=params,
                                                    session_params=None))
    assert ok.extra_key == (None if mode == "on" else "engram=off|")


class _Batch:
    """A stand-in for SGLang's batched GenerateReqInput: `batch[i]` is cached, as SGLang's is."""

    def __init__(self, elements):
        self.batch_size = len(elements)
        self._elements = elements

    def __getitem__(self, i):
        return self.__dict__.setdefault("_sub_obj_cache", {}).setdefault(i, self._elements[i])


def _batch_manager(monkeypatch):
    from engram_sglang.plugin import tokenizer_manager
    from engram_sglang.serving.settings import ServeSettings

    monkeypatch.setattr(tokenizer_manager, "_settings", [ServeSettings(mode="on")])

    class TokenizerManager:
        model_config = SimpleNamespace(vocab_size=VOCAB)

        def _create_tokenized_object(self, obj):
            return obj

        async def _handle_batch_request(self, obj):  # tokenizes each element in turn, as SGLang's does
            for i in range(obj.batch_size):
                yield self._create_tokenized_object(obj[i])

    plugin.patch(SimpleNamespace(TokenizerManager=TokenizerManager), "sglang.srt.managers.tokenizer_manager")
    return TokenizerManager()


def _run_batch(manager, batch):
    import asyncio

    async def collect():
        return [r async for r in manager._handle_batch_request(batch)]

    return asyncio.run(collect())


def test_a_batch_with_one_bad_element_names_its_index(monkeypatch):
    manager = _batch_manager(monkeypatch)
    params = SimpleNamespace(custom_params=None)
    elements = [tokenized([5, 6], extra_key=None, sampling_params=params, session_params=None) for _ in range(8)]
    elements[3] = tokenized([5, VOCAB + 1], extra_key=None, sampling_params=params, session_params=None)
    with pytest.raises(TokenIdError) as e:
        _run_batch(manager, _Batch(elements))
    assert str(e.value).startswith(f"batch[3] of 8: input_ids: token id {VOCAB + 1} is outside"), str(e.value)
    bad_mode = SimpleNamespace(custom_params={"engram": "sideways"})
    elements[3] = tokenized([5, 6], extra_key=None, sampling_params=bad_mode, session_params=None)
    with pytest.raises(ValueError, match=r'^batch\[3\] of 8: sampling_params.custom_params\["engram"\]'):
        _run_batch(manager, _Batch(elements))
    # Negative control: a good batch goes through whole; a single request's line has no index.
    elements[3] = tokenized([5, 6], extra_key=None, sampling_params=params, session_params=None)
    assert len(_run_batch(manager, _Batch(elements))) == 8
    with pytest.raises(TokenIdError, match=r"^input_ids: token id -1 "):
        manager._create_tokenized_object(tokenized([-1]))


def _stream_request(ids, params, **extra):
    """A stand-in for SGLang's GenerateReqInput as http_server hands it over (not normalized)."""
    return SimpleNamespace(input_ids=ids, sampling_params=params, text=None, session_params=None,
                           contains_mm_input=lambda: False, **extra)


def test_a_streamed_request_is_checked_before_its_stream_with_the_same_lines():
    from engram_sglang.serving.request_check import check_before_stream
    from engram_sglang.serving.settings import ServeSettings

    on = ServeSettings(mode="on", ablation=True)
    bad_mode = {"max_new_tokens": 2, "custom_params": {"engram": "sideways"}}
    with pytest.raises(ValueError, match=r'^sampling_params.custom_params\["engram"\] must be'):
        check_before_stream(_stream_request([5, 6], bad_mode), on, VOCAB)
    with pytest.raises(ValueError, match="^sampling_params.custom_params must be a JSON object"):
        check_before_stream(_stream_request([5, 6], {"custom_params": "off"}), on, VOCAB)
    with pytest.raises(TokenIdError, match=f"^input_ids: token id {VOCAB} "):
        check_before_stream(_stream_request([5, VOCAB], {}), on, VOCAB)
    with pytest.raises(TokenIdError, match=r"^batch\[1\] of 3: input_ids: token id -1 "):
        check_before_stream(_stream_request([[5], [-1], [7]], {}), on, VOCAB)
    with pytest.raises(ValueError, match=r"^batch\[2\] of 3: sampling_params"):
        check_before_stream(_stream_request([[5], [6], [7]], [{}, {}, bad_mode]), on, VOCAB)
    # Negative controls: good requests pass, text prompts and a mode on a server without ablation
    # as the tokenizer manager sees them (the latter is refused there too: needs --engram-ablation on).
    check_before_stream(_stream_request([[5], [6]], [{}, {"custom_params": {"engram": "off"}}]), on, VOCAB)
    check_before_stream(_stream_request(None, {"max_new_tokens": 2}), on, VOCAB)
    with pytest.raises(ValueError, match="needs a server started with --engram-ablation on"):
        check_before_stream(_stream_request([5], {"custom_params": {"engram": "off"}}), ServeSettings(), VOCAB)


# ------------------------------------------------------------------ the forward
def _extend_batch(slots, lens):
    mode = SimpleNamespace(is_idle=lambda: False, is_decode=lambda: False, is_target_verify=lambda: False,
                           is_extend=lambda: True, name="EXTEND")
    return SimpleNamespace(forward_mode=mode, req_pool_indices=torch.tensor(slots),
                           extend_seq_lens=torch.tensor(lens), extend_seq_lens_cpu=list(lens))


@pytest.fixture
def runtime(tmp_path):
    from engram_sglang.core.hashing import NgramHasher
    from engram_sglang.serving.runtime import EngramRuntime
    from engram_sglang.serving.settings import ServeSettings
    from tests.support.tables import random_table_dir, small_config

    cfg = small_config(400)
    root, _ = random_table_dir(tmp_path, cfg)
    gen = torch.Generator().manual_seed(0)
    hasher = NgramHasher(cfg, torch.randint(0, cfg.compressed_vocab_size, (cfg.vocab_size,), generator=gen))
    rt = EngramRuntime(cfg, hasher, ServeSettings(placement="device"), root, torch.device("cpu"))
    yield rt
    rt.close()


def test_an_unknown_id_in_the_forward_fails_only_its_request(runtime, monkeypatch):
    """Three requests in one extend step, slot 7's prompt holding -1 and slot 9's the
    tokenizer's size: those two requests are failed (their slots kept for the scheduler, which
    aborts exactly them), their ids hash as the pad token, slot 5 is untouched; the scheduler
    hook then aborts exactly those two."""
    from sglang.srt.managers.schedule_batch import FINISH_ABORT

    from engram_sglang.serving import faults

    known = runtime.hasher.token_map.numel()
    ids = torch.tensor([1, 2, 3, 4, -1, 6, 7, 8, known])
    batch = _extend_batch([5, 7, 9], [3, 3, 3])
    with pytest.raises(Exception, match="outside the tokenizer"):
        runtime.hasher.hash_sequence(ids.tolist())  # what the step's hasher would raise in the forward
    got = runtime.refuse_unknown_tokens(ids, batch)
    pad = runtime.cfg.pad_token_id
    assert got.tolist() == [1, 2, 3, 4, pad, 6, 7, 8, pad]
    runtime.hasher.hash_sequence(got.tolist())  # now hashable
    monkeypatch.setattr(faults, "active_runtimes", lambda: [runtime])
    reqs = [SimpleNamespace(kv=SimpleNamespace(req_pool_idx=i), to_finish=None, finished=lambda: False)
            for i in (5, 7, 9)]
    assert faults.abort_failed_requests(SimpleNamespace(tp_size=1), SimpleNamespace(reqs=reqs)) == 2
    assert reqs[0].to_finish is None
    for req, token in zip(reqs[1:], (-1, known)):
        assert isinstance(req.to_finish, FINISH_ABORT)
        assert f"token id {token} is outside the tokenizer's {known} tokens" in req.to_finish.message
    assert runtime.take_failed_requests() == {}


def test_known_ids_in_the_forward_fail_nothing(runtime):
    """The control: ids 0..size-1 come back as the very tensor, no request failed."""
    known = runtime.hasher.token_map.numel()
    ids = torch.tensor([0, 5, known - 1])
    assert runtime.refuse_unknown_tokens(ids, _extend_batch([4], [3])) is ids
    assert runtime.take_failed_requests() == {}


def test_a_huge_token_id_is_echoed_cut_short():
    with pytest.raises(TokenIdError) as e:
        check_token_ids(SimpleNamespace(input_ids=[1, 10 ** 200]), 100)
    assert len(str(e.value)) < 300 and "bytes)" in str(e.value)
    with pytest.raises(TokenIdError, match="token id 100 is"):  # negative control: a short id whole
        check_token_ids(SimpleNamespace(input_ids=[1, 100]), 100)
