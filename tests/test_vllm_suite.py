"""benchmarks/vllm_suite.py's glue without vLLM: the probes it exports are the suite's, and answers (token ids,
as an engine returns them) are cut, decoded and scored as the suite scores them, paired the right way round."""

from __future__ import annotations

import json

import pytest
from conftest import load_benchmark

from leank_train.evaluation.tasks import build_probes, chat_ids

EOS = 2
TASKS = ["niah_single_number", "passkey"]


def digit_tokenizer():
    """Words are one unknown token each, digits one token each, decoded without spaces (so a number round
    trips through ids): fast, and enough for the number-valued tasks."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": EOS, **{str(d): 3 + d for d in range(10)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Whitespace(), pre_tokenizers.Digits(individual_digits=True)])
    tok.decoder = decoders.Fuse()
    t = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    t.chat_template = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                       "{% if add_generation_prompt %}assistant:{% endif %}")
    return t


@pytest.fixture(scope="module")
def suite():
    return load_benchmark("vllm_suite")


@pytest.fixture(scope="module")
def tok():
    return digit_tokenizer()


@pytest.fixture(scope="module")
def probes(suite, tok):
    runs = suite.plan([300, 400], 3, TASKS, ["400:2:passkey"])
    # through JSON, as the engines' processes read them
    return json.loads(json.dumps(suite.export_probes(tok, runs, seed=5)))


def test_plan_replaces_a_length(suite):
    assert suite.plan([1024, 2048], 25, ["a", "b"], ["2048:45:a", "4096:9:b,c"]) == [
        (1024, 25, ["a", "b"]), (2048, 45, ["a"]), (4096, 9, ["b", "c"])]


def test_exported_probes_are_the_suites(probes, tok):
    """The same probes, in the same order, with the prompt ids `leank eval` feeds the model and each
    task's budget; every prompt and its answer fit the length."""
    want = [(p, n) for n, tasks, samples in ((300, TASKS, 3), (400, ["passkey"], 2))
            for p in build_probes(tok, tasks, [n], samples, seed=5)]
    assert len(probes) == len(want) == 8
    for row, (p, n) in zip(probes, want, strict=True):
        assert (row["kind"], row["length"], row["index"], row["expected"]) == (p.kind, n, p.index, p.expected)
        assert row["prompt_token_ids"] == chat_ids(tok, p.messages, p.answer_prefix)
        assert row["max_new_tokens"] == p.max_new_tokens > 0
        assert len(row["prompt_token_ids"]) + row["max_new_tokens"] <= n
    assert len({tuple(r["prompt_token_ids"]) for r in probes}) == 8  # distinct prompts: a mix-up shows


def test_answers_are_cut_decoded_scored_and_paired(suite, probes, tok):
    """Fake engines: the reference right everywhere but probe 0; vllm-fp8 everywhere but probe 4; leank-fp8's
    value comes after an end of sequence on probes 1 and 2 and after the budget on probe 3 (all wrong),
    otherwise right."""
    def ids(text):
        return tok(text, add_special_tokens=False)["input_ids"]

    def right(p):
        return ids(" is " + " ".join(p["expected"]) + " .")

    def late(p, where):
        pad = [EOS] if where == "eos" else ids("x") * p["max_new_tokens"]
        return ids(" is") + pad + right(p)

    gens = {"vllm-fp32": [ids("no idea") if i == 0 else right(p) for i, p in enumerate(probes)],
            "vllm-fp8": [ids("no idea") if i == 4 else right(p) for i, p in enumerate(probes)],
            "leank-fp8": [late(p, "eos") if i in (1, 2) else late(p, "budget") if i == 3 else right(p)
                          for i, p in enumerate(probes)]}
    res = suite.score(tok, probes, gens, {EOS})
    assert res["methods"] == ["full", "vllm-fp8", "leank-fp8"]
    assert [r["correct"]["full"] for r in res["answers"]] == [False] + [True] * 7
    assert [r["correct"]["leank-fp8"] for r in res["answers"]] == [True, False, False, False] + [True] * 4
    assert res["answers"][1]["leank-fp8"] == ""  # the text stops at the end of sequence (words are <unk>)
    # probes 0-2: niah_single_number at 300; 3-5: passkey at 300; 6-7: passkey at 400
    number = res["tasks"]["niah_single_number"]
    assert number["full"][300]["correct"] == 2 and number["vllm-fp8"][300]["correct"] == 3
    # the reference misses probe 0 only, leank-fp8 gets only probe 0: 2 against 1
    assert number["leank-fp8"][300]["paired"] == {"both": 0, "only_full": 2, "only_method": 1, "neither": 0,
                                                  "mcnemar_p": 1.0}
    assert res["headline"][300]["tasks"] == ["passkey"]  # full: 2/3 < 0.8 on the number task, 3/3 on passkey
    assert res["headline"][400]["tasks"] == ["passkey"] and res["headline"][400]["leank-fp8"]["score"] == 1.0
    # against plain fp8 (not the reference), on the reference's headline tasks: passkey 300 -> probes 3-5
    vs_fp8 = suite.compare(res, "leank-fp8", "vllm-fp8")
    assert (vs_fp8[300]["only_full"], vs_fp8[300]["only_method"], vs_fp8[300]["both"]) == (1, 1, 1)
    assert (vs_fp8[400]["only_full"], vs_fp8[400]["both"]) == (0, 2)
    table = suite.comparison_table(res, suite.plan([300, 400], 3, TASKS, ["400:2:passkey"]))
    assert "| 300 | 3 | passkey | 1.000 +/- 0.000 | 0.667 +/- 0.272 | 0.667 +/- 0.272 | -1/+0 (p=1) | -1/+1 (p=1) |" in table
    assert "leank-fp8 vs vllm-fp8" in table and "leank-fp32" not in table  # only the engines that ran
