"""What the engine gained for the server: per-request logprobs, presence / frequency penalties, a token constraint
(the structured-output hook) and reserve(); a request using them samples the same alone and in any batch, and plain
greedy requests beside them are unchanged."""

import pytest
import torch
from helpers import save_hf_dir, tiny_llama

import sluice
from sluice.engine.sampler import SamplingBatch, filtered_probs, output_counts
from sluice.engine.sampling import Sampler, SamplingParams
from sluice.errors import InvalidOptionError


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return sluice.load(save_hf_dir(tiny_llama(seed=4), tmp_path_factory.mktemp("llama")), device="cpu")


def prompts(n, seed=0, vocab=260):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (int(t),), generator=g).tolist() for t in torch.randint(3, 40, (n,), generator=g)]


def run(model, ids, **kw):
    """(output ids, StepOutputs) of one request run alone."""
    seq = model.engine.add_request(ids, stop_ids=(), **kw)
    outs = []
    while not seq.finished:
        outs += [o for o in model.engine.step() if o.seq is seq]
    return seq.output, outs


class OnlyTokens:
    """A constraint that allows a fixed set of tokens and records what it was told."""

    def __init__(self, vocab, allowed):
        self.mask = torch.zeros(vocab, dtype=torch.bool)
        self.mask[allowed] = True
        self.seen = []

    def allowed(self):
        return self.mask

    def advance(self, token):
        self.seen.append(token)


def test_logprobs_are_the_models(model):
    ids = prompts(1)[0]
    plain, _ = run(model, ids, max_tokens=8)
    out, steps = run(model, ids, max_tokens=8, logprobs=4)
    assert out == plain  # asking for logprobs changes nothing
    logits = model.logits(ids + out[:-1])[0, len(ids) - 1:]  # the distribution each output token came from
    want = torch.log_softmax(logits, -1)
    for i, step in enumerate(steps):
        assert step.token == out[i] and step.logprob == pytest.approx(float(want[i, out[i]]), abs=1e-4)
        top = want[i].topk(4)
        assert [t for t, _ in step.top_logprobs] == top.indices.tolist()
        assert [lp for _, lp in step.top_logprobs] == pytest.approx(top.values.tolist(), abs=1e-4)
    _, none = run(model, ids, max_tokens=2, logprobs=0)
    assert none[0].top_logprobs == [] and none[0].logprob <= 0


def test_greedy_penalties_follow_the_openai_formula(model):
    ids, pp, fp = prompts(1, seed=1)[0], 0.7, 0.4
    out, _ = run(model, ids, max_tokens=12, presence_penalty=pp, frequency_penalty=fp)
    for i in range(len(out)):
        x = model.logits(ids + out[:i])[0, -1]
        counts = torch.bincount(torch.tensor(out[:i], dtype=torch.long), minlength=x.numel()).float()
        assert int((x - counts * fp - (counts > 0) * pp).argmax()) == out[i]
    assert out != run(model, ids, max_tokens=12)[0]  # the penalties did something


def test_penalised_distribution_matches_the_host_sampler(monkeypatch):
    vocab, g = 50, torch.Generator().manual_seed(2)
    logits = 3 * torch.randn(3, vocab, generator=g)
    outputs = [torch.randint(0, vocab, (9,), generator=g).tolist() for _ in range(3)]
    params = [SamplingParams(temperature=1.0, presence_penalty=0.8, frequency_penalty=-0.3),
              SamplingParams(temperature=0.7, top_k=20, frequency_penalty=1.5), SamplingParams(temperature=1.0)]
    probs = filtered_probs(logits, SamplingBatch(params, [1, 2, 3], [9] * 3, "cpu"),
                           counts=output_counts([o if p.counts_output else () for o, p in zip(outputs, params)],
                                                vocab, "cpu"))
    for i, p in enumerate(params):
        captured = []
        monkeypatch.setattr(torch, "multinomial", lambda pr, n, generator=None: captured.append(pr) or
                            torch.zeros(n, dtype=torch.long))
        Sampler(p)(logits[i].clone(), output=outputs[i])
        torch.testing.assert_close(probs[i] / probs[i].sum(), captured[0], atol=1e-6, rtol=1e-5)


def test_constraint_masks_every_draw(model):
    ids, allowed = prompts(1, seed=2)[0], [5, 17, 99, 200]
    for sampling in ({}, {"temperature": 1.0, "seed": 3}):
        c = OnlyTokens(model.config.vocab_size, allowed)
        out, _ = run(model, ids, max_tokens=10, constraint=c, **sampling)
        assert len(out) == 10 and set(out) <= set(allowed) and c.seen == out


@pytest.mark.parametrize("overlap", [False, True])
def test_mixed_features_do_not_change_each_others_tokens(model, overlap):
    """... with decode steps read back at once or run ahead (`overlap`: a batch holding rows that need the host
    reads back; the plain and seeded rows alone run ahead)."""
    model = model.with_engine(overlap=overlap)
    ps = prompts(5, seed=3)
    vocab = model.config.vocab_size
    kinds = [{}, {"logprobs": 2}, {"temperature": 0.9, "seed": 5, "presence_penalty": 0.5, "frequency_penalty": 0.5},
             {"temperature": 0.8, "seed": 6, "top_k": 20, "repetition_penalty": 1.3},
             {"constraint": lambda: OnlyTokens(vocab, list(range(0, vocab, 3)))}]

    def options(k):
        return {key: (v() if key == "constraint" else v) for key, v in k.items()}

    alone = [run(model, p, max_tokens=10, **options(k))[0] for p, k in zip(ps, kinds)]
    seqs = [model.engine.add_request(p, max_tokens=10, stop_ids=(), **options(k)) for p, k in zip(ps, kinds)]
    model.engine.run(seqs)
    assert [s.output for s in seqs] == alone


def test_bad_options_and_reserve(model, tmp_path):
    with pytest.raises(InvalidOptionError, match="presence_penalty"):
        model.engine.add_request([1, 2], max_tokens=2, presence_penalty=2.5)
    with pytest.raises(InvalidOptionError, match="frequency_penalty"):
        SamplingParams(frequency_penalty="1").validate()
    with pytest.raises(InvalidOptionError, match="logprobs"):
        model.engine.add_request([1, 2], max_tokens=2, logprobs=-1)
    with pytest.raises(InvalidOptionError, match="max_seq_len"):
        model.engine.reserve()
    fixed = sluice.load(save_hf_dir(tiny_llama(seed=4), tmp_path / "m"), device="cpu", max_batch=3, max_seq_len=64)
    fixed.engine.reserve()
    assert (fixed.engine.runner.pool.rows, fixed.engine.rows.free_rows) == (3, 3)
    assert fixed.engine.runner.pool.capacity >= 64
