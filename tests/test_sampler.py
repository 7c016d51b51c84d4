import pytest
import torch

from sluice.engine.sampler import (SamplingBatch, fill_seen, filtered_probs, mark_seen, random_seed, row_key,
                                   sample, uniforms)
from sluice.engine.sampling import Sampler, SamplingParams

P = SamplingParams


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def batch(params, seeds=None, counters=None, device="cpu") -> SamplingBatch:
    n = len(params)
    return SamplingBatch(params, list(range(n)) if seeds is None else seeds, [0] * n if counters is None else counters,
                         device)


def test_all_greedy_is_argmax():
    logits = torch.randn(7, 50, generator=gen(0))
    b = batch([P()] * 7)
    assert b.all_greedy and not b.needs_seen
    assert torch.equal(sample(logits, b), logits.argmax(-1))


def test_mixed_batch_greedy_rows_take_the_argmax():
    logits = torch.randn(8, 50, generator=gen(1))
    params = [P() if i % 2 == 0 else P(temperature=5.0, top_k=40) for i in range(8)]
    draws = torch.stack([sample(logits, batch(params, counters=[c] * 8)) for c in range(20)])  # [20, 8]
    assert not batch(params).all_greedy
    assert (draws[:, 0::2] == logits[0::2].argmax(-1)).all()
    assert not (draws[:, 1::2] == logits[1::2].argmax(-1)).all()


# each filter alone, then combined; every case is one row of the batch in test_filters_match_sampler
CASES = [P(temperature=1.0), P(temperature=0.4), P(temperature=2.5), P(temperature=1.0, top_k=1),
         P(temperature=1.3, top_k=7), P(temperature=1.0, top_k=64), P(temperature=1.0, top_p=0.5),
         P(temperature=0.7, top_p=0.95), P(temperature=1.0, min_p=0.05), P(temperature=1.8, min_p=0.3),
         P(temperature=1.0, repetition_penalty=1.6), P(temperature=1.0, repetition_penalty=0.7),
         P(temperature=0.8, top_k=20, top_p=0.9), P(temperature=1.2, min_p=0.02, top_p=0.8),
         P(temperature=0.9, top_k=30, top_p=0.85, min_p=0.01, repetition_penalty=1.3),
         P(temperature=0.0, repetition_penalty=2.0), P(temperature=0.0, top_k=3, top_p=0.5)]


def sampler_probs(monkeypatch, logits: torch.Tensor, params: SamplingParams, history: list[int]) -> torch.Tensor:
    """The normalised probabilities sampling.Sampler hands to torch.multinomial for one row."""
    captured = []

    def multinomial(probs, n, generator=None):
        captured.append(probs.clone())
        return torch.zeros(n, dtype=torch.long)

    with monkeypatch.context() as m:
        m.setattr(torch, "multinomial", multinomial)
        Sampler(params)(logits.clone(), history)
    return captured[0]


def check_against_sampler(monkeypatch, logits, params, histories, got_probs, got_ids):
    for i, p in enumerate(params):
        if p.temperature == 0:
            assert int(got_ids[i]) == Sampler(p)(logits[i].clone(), histories[i])
            continue
        want = sampler_probs(monkeypatch, logits[i], p, histories[i])
        got = got_probs[i] / got_probs[i].sum()
        assert torch.equal(got > 0, want > 0), (i, p)
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
        assert want[int(got_ids[i])] > 0


def test_filters_match_sampler(monkeypatch):
    n, vocab = len(CASES), 64
    logits = 3 * torch.randn(n, vocab, generator=gen(2))
    histories = [torch.randint(0, vocab, (12,), generator=gen(100 + i)).tolist() for i in range(n)]
    # the seen pool holds the rows in another order than the batch, plus rows of no one
    rows = torch.randperm(n + 3, generator=gen(3))[:n]
    pool = torch.ones(n + 3, vocab, dtype=torch.bool)
    for i, h in enumerate(histories):
        fill_seen(pool, int(rows[i]), h)
    b = batch(CASES)
    assert b.needs_seen and b.max_top_k == 64 and b.any_min_p and b.any_top_p and not b.top_p_within_top_k
    probs, ids = filtered_probs(logits, b, pool, rows), sample(logits, b, pool, rows)
    assert torch.equal(ids, sample(logits, b, pool[rows]))  # the gathered mask gives the same
    check_against_sampler(monkeypatch, logits, CASES, histories, probs, ids)
    for i, p in enumerate(CASES):  # each case alone
        one = batch([p])
        check_against_sampler(monkeypatch, logits[i:i + 1], [p], histories[i:i + 1],
                              filtered_probs(logits[i:i + 1], one, pool[rows[i:i + 1]]),
                              sample(logits[i:i + 1], one, pool, rows[i:i + 1]))


def test_ties_at_the_kth_logit_are_kept(monkeypatch):
    logits = torch.tensor([[3.0, 2.0, 1.0, 1.0, 1.0, 0.0, -1.0, 1.0]])
    for p in (P(temperature=1.0, top_k=3), P(temperature=1.0, top_k=3, top_p=0.99), P(temperature=1.0, top_k=4)):
        b = batch([p])
        probs = filtered_probs(logits, b)
        assert (probs[0] > 0).tolist() == [True] * 5 + [False, False, True]
        check_against_sampler(monkeypatch, logits, [p], [[]], probs, sample(logits, b))


def chi_square(ids: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson's statistic of the draws ids against probs [V]; a draw of a zero-probability token is infinite."""
    counts = torch.bincount(ids, minlength=probs.numel()).double()
    expected = probs.double() / probs.sum() * ids.numel()
    if (counts[expected == 0] > 0).any():
        return float("inf")
    keep = expected > 0
    return float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())


@pytest.mark.parametrize("params", [P(temperature=1.0), P(temperature=0.7, top_p=0.9), P(temperature=1.5, top_k=4),
                                    P(temperature=1.0, min_p=0.1, repetition_penalty=1.5)])
def test_frequencies_follow_the_distribution(params):
    n, vocab = 20000, 6
    logits = torch.tensor([[1.2, 0.4, 0.0, -0.5, -1.0, -2.5]]).expand(n, vocab)
    seen = torch.zeros(n, vocab, dtype=torch.bool)
    seen[:, 0] = True
    # half the draws vary the seed (counter 0), half the counter (one seed)
    b = SamplingBatch([params] * n, list(range(n // 2)) + [12345] * (n // 2), [0] * (n // 2) + list(range(n // 2)),
                      "cpu")
    ids = sample(logits, b, seen)
    probs = filtered_probs(logits[:1], batch([params]), seen[:1])[0]
    # 5 degrees of freedom at most: P(chi2 > 25) < 2e-4
    assert chi_square(ids[:n // 2], probs) < 25 and chi_square(ids[n // 2:], probs) < 25


OTHERS = [P(), P(temperature=1.0), P(temperature=0.5, top_k=3), P(temperature=1.5, top_p=0.6),
          P(temperature=1.0, min_p=0.2, repetition_penalty=1.4), P(temperature=2.0, top_k=50, top_p=0.99)]


@pytest.mark.parametrize("params", [P(temperature=1.0), P(temperature=0.8, top_k=10), P(temperature=1.1, top_p=0.9),
                                    P(temperature=0.9, top_k=10, top_p=0.8),
                                    P(temperature=1.0, min_p=0.05, repetition_penalty=1.2)])
def test_a_row_draws_the_same_alone_and_in_any_batch(params):
    vocab = 200
    g = gen(4)
    for trial in range(10):
        logits, seen = torch.randn(1, vocab, generator=g), torch.rand(1, vocab, generator=g) < 0.1
        seed, counter = random_seed(), trial * 7
        alone = sample(logits, batch([params], [seed], [counter]), seen)
        for at in (0, 2, 4):
            others = [OTHERS[(trial + j) % len(OTHERS)] for j in range(4)]
            big_logits = torch.randn(5, vocab, generator=g)
            big_seen = torch.rand(5, vocab, generator=g) < 0.1
            big_logits[at], big_seen[at] = logits[0], seen[0]
            seeds = torch.randint(0, 2**62, (5,), generator=g).tolist()
            counters = torch.randint(0, 1000, (5,), generator=g).tolist()
            seeds[at], counters[at] = seed, counter
            got = sample(big_logits, batch(others[:at] + [params] + others[at:], seeds, counters), big_seen)
            assert int(got[at]) == int(alone[0]), (trial, at)


def test_persistent_buffers():
    logits = torch.randn(3, 40, generator=gen(5))
    params, seeds, counters = [P(temperature=1.0), P(), P(temperature=0.5, top_p=0.8)], [1, 2, 3], [4, 5, 6]
    buffers = SamplingBatch([P()] * 8, [0] * 8, [0] * 8, "cpu")
    b = SamplingBatch(params, seeds, counters, "cpu", out=buffers)
    assert b.floats.data_ptr() == buffers.floats.data_ptr() and b.ints.data_ptr() == buffers.ints.data_ptr()
    assert not b.all_greedy and b.any_top_p
    assert torch.equal(sample(logits, b), sample(logits, SamplingBatch(params, seeds, counters, "cpu")))
    with pytest.raises(ValueError):
        SamplingBatch([P()] * 9, [0] * 9, [0] * 9, "cpu", out=buffers)


def test_seen_helpers():
    seen = torch.zeros(4, 10, dtype=torch.bool)
    fill_seen(seen, 2, [3, 3, 7])
    mark_seen(seen, torch.tensor([2, 0]), torch.tensor([1, 9]))
    assert seen.nonzero().tolist() == [[0, 9], [2, 1], [2, 3], [2, 7]]
    fill_seen(seen, 2, [])
    assert seen.nonzero().tolist() == [[0, 9]]


def test_penalty_without_seen_mask_is_an_error():
    with pytest.raises(ValueError):
        sample(torch.zeros(1, 5), batch([P(temperature=1.0, repetition_penalty=1.1)]))


def test_counters_give_different_draws():
    logits = torch.zeros(200, 1000)
    ids = sample(logits, batch([P(temperature=1.0)] * 200, [42] * 200, list(range(200))))
    assert ids.unique().numel() > 150  # ~181 expected from 200 uniform draws of 1000


def test_uniforms_are_uniform_and_independent():
    rows, vocab = 64, 4096
    seeds = [random_seed() for _ in range(rows // 2)]
    u = uniforms(torch.tensor([row_key(s, c) for c in (0, 1) for s in seeds]), vocab).double()
    assert u.min() > 0 and u.max() < 1
    assert ((u * 2**24) % 2 == 1).all()  # odd multiples of 2**-24
    assert abs(float(u.mean()) - 0.5) < 0.003  # standard error 0.00056
    hist = torch.histc(u, bins=16, min=0, max=1) / u.numel()
    assert (hist - 1 / 16).abs().max() < 0.004  # standard error 0.0005
    centred = u - 0.5

    def corr(a, b):
        return float((a * b).mean() / (a.square().mean() * b.square().mean()).sqrt())

    assert abs(corr(centred[:rows // 2], centred[rows // 2:])) < 0.01  # counter 0 vs counter 1, same seeds
    assert abs(corr(centred[:, :-1], centred[:, 1:])) < 0.01  # neighbouring tokens
    assert abs(corr(centred[:-1], centred[1:])) < 0.01  # neighbouring seeds


def test_every_seed_and_counter_bit_counts():
    keys = [row_key(s, c) for s in (5, 5 + 2**32, 5 + 2**62, -5, 2**63 - 5) for c in (0, 1, 2**31)]
    assert len(set(keys)) == len(keys) and all(0 <= k < 2**32 for k in keys)
    assert row_key(-5, 0) == row_key(2**64 - 5, 0) and row_key(7, 3) == row_key(7 + 2**64, 3)  # seeds modulo 2**64
    assert batch([P()], [7], [3]).key.tolist() == [row_key(7, 3)]
    with pytest.raises(ValueError):
        batch([P()], [7], [2**32])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_matches_cpu_without_syncing():
    n, vocab = 32, 5000
    logits = 2 * torch.randn(n, vocab, generator=gen(6))
    seen = torch.rand(n, vocab, generator=gen(7)) < 0.05
    params = [CASES[i % len(CASES)] for i in range(n)]
    seeds, counters = [random_seed() for _ in range(n)], list(range(n))
    cpu = sample(logits, batch(params, seeds, counters), seen)
    dev = torch.device("cuda")
    logits_d, seen_d = logits.to(dev), seen.to(dev)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        b = batch(params, seeds, counters, dev)
        ids = sample(logits_d, b, seen_d)
        mark_seen(seen_d, torch.arange(n, device=dev), ids)
        u = uniforms(b.key, vocab)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.equal(u.cpu(), uniforms(torch.tensor([row_key(s, c) for s, c in zip(seeds, counters)]), vocab))
    assert torch.equal(ids.cpu(), cpu)
    assert seen_d.cpu()[torch.arange(n), cpu].all()
