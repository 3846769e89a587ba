"""Sampling is lossless: with ddtree the first two tokens follow the target's own distribution.

A tiny random target with a 12-token vocabulary makes the exact joint distribution of the first
two tokens computable (12 x 12 cells). Samples from ddtree (budget 8, a random drafter, so many
rounds accept draft nodes) are compared to it with Pearson's chi-square test at significance
level alpha = 0.001, with a fixed seed. The same samples must *fail* against a different
temperature's distribution, which shows the test has the power to see a wrong sampler.
"""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from ddtree.decoding import DrafterRunner, Sampling, generate
from ddtree.modeling_dflash import DFlashDraftModel
from ddtree.targets import build_drafter_config
from rigged import hf_greedy  # tests/rigged.py

ALPHA = 1e-3
VOCAB = 12
PROMPT = [1, 2, 3]
# 1000 samples keep the power: against the 1.6x temperature, p was 1e-24 to 1e-45 for four seeds (1e-52 to 1e-104
# with 2000), against the true distribution 0.08 to 0.97 (2026-12-01). At T1 they are needed: samples drawn at 1.35x
# the temperature gave p 2e-7 against the true distribution with 1000 and 0.003 (passing) with 500 (2026-12-07).
RUNS = 1000
# Under top-k and top-p a skew moves tokens across the cuts, where expected counts are 0: with 500 samples (at
# T0.7, top-p 0.9, top-k 8) p against the 1.6x temperature was 7e-20 to 9e-23 for three seeds, against the true
# distribution 0.07 to 0.82, and with top-p applied twice, the temperature squared, top-k left out or the temperature
# 1.2x, 1e-9 to 1e-66 (2026-12-07). 1000 samples took 12 s on a 2-core AVX2 EPYC. With 350 (seeds 1234, 1, 2),
# against the true distribution 0.24 to 0.73, the 1.6x temperature 1e-13 to 1e-16, and those four skews and top-p
# keeping one token fewer 1.4e-6 to 4e-38; with 300 top-k left out was 2.6e-4 for seed 1, too near alpha (2026-12-07).
CUT_RUNS = 350


@pytest.fixture(scope="module")
def tiny_pair():
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, max_position_embeddings=64, initializer_range=0.3,
        attn_implementation="sdpa",
    )
    target = LlamaForCausalLM(config).eval()
    drafter_config = build_drafter_config(target, None, "tiny", num_layers=1, block_size=4,
                                          target_layer_ids=[0, 1], mask_token_id=VOCAB - 1)
    return target, DrafterRunner(DFlashDraftModel(drafter_config).eval(), target)


def exact_joint(target, sampling: Sampling) -> torch.Tensor:
    with torch.no_grad():
        first = sampling.probabilities(target(torch.tensor([PROMPT])).logits[0, -1])
        rows = target(torch.tensor([PROMPT + [t] for t in range(VOCAB)])).logits[:, -1]
        second = torch.stack([sampling.probabilities(r) for r in rows])
    return (first[:, None] * second).double()  # (V, V)


def chi_square_p(counts: torch.Tensor, probs: torch.Tensor) -> float:
    observed = counts.flatten().double()
    expected = probs.flatten() / probs.sum() * observed.sum()  # exact totals, as the statistic assumes
    small = expected < 5  # pool sparse cells so the chi-square approximation holds
    observed = torch.cat([observed[~small], observed[small].sum()[None]])
    expected = torch.cat([expected[~small], expected[small].sum()[None]])
    keep = expected > 0
    observed, expected = observed[keep], expected[keep]
    statistic = ((observed - expected) ** 2 / expected).sum()
    # Pearson's statistic follows chi-square with (cells - 1) degrees of freedom: its survival function is the
    # regularized upper incomplete gamma function Q(df / 2, statistic / 2)
    degrees = torch.tensor((len(observed) - 1) / 2, dtype=torch.float64)
    return float(torch.special.gammaincc(degrees, statistic / 2))


@pytest.mark.parametrize("sampling, runs", [(Sampling(1.0), RUNS), (Sampling(0.7, top_p=0.9, top_k=8), CUT_RUNS)],
                         ids=["T1", "T0.7-p0.9-k8"])
def test_ddtree_sampling_matches_the_target(tiny_pair, sampling, runs):
    target, drafter = tiny_pair
    generator = torch.Generator().manual_seed(1234)
    counts = torch.zeros(VOCAB, VOCAB)
    committed = rounds = 0
    for _ in range(runs):
        result = generate(target, PROMPT, "ddtree", drafter, 8, 3, [], sampling, generator)
        counts[result.new_tokens[0], result.new_tokens[1]] += 1
        committed += sum(r.committed for r in result.rounds)
        rounds += len(result.rounds)
    assert committed / rounds > 1.2, "the tree was rarely accepted, so the test would not exercise it"
    assert chi_square_p(counts, exact_joint(target, sampling)) > ALPHA
    hotter = Sampling(sampling.temperature * 1.6, sampling.top_p, sampling.top_k)
    assert chi_square_p(counts, exact_joint(target, hotter)) < ALPHA


@pytest.mark.parametrize("temperature", [1e-39, 1e-300, 1e-310])
def test_a_tiny_temperature_samples_the_argmax(tiny_pair, temperature):
    """Logits over a tiny temperature overflow float32, and below about 1e-307 float64 too (30 / 1e-310 is inf, and a
    softmax over infs NaN); the distribution must still be the argmax's, not NaN."""
    target, drafter = tiny_pair
    logits = torch.tensor([30.0, 10.0, -5.0, 29.0])
    assert torch.equal(Sampling(temperature).probabilities(logits), torch.tensor([1.0, 0.0, 0.0, 0.0]))
    greedy = hf_greedy(target, PROMPT, 6)
    for method, runner in (("ar", None), ("ddtree", drafter)):
        result = generate(target, PROMPT, method, runner, 8, 6, [], Sampling(temperature), torch.Generator().manual_seed(0))
        assert result.new_tokens == greedy, method


def test_more_redrafts_than_the_vocabulary_has_tokens(tiny_pair):
    """Re-drafts are capped by the budget first (a tree holds at most `budget` depth-1 tokens): at budget 8 a vocabulary
    of 12 never bound, so the test passed without the vocabulary's cap. A budget above it needs that cap too."""
    target, drafter = tiny_pair
    greedy = hf_greedy(target, PROMPT, 6)
    assert generate(target, PROMPT, "ddtree", drafter, VOCAB + 4, 6, [], redraft=VOCAB + 8).new_tokens == greedy


@pytest.mark.parametrize("sampling", [Sampling(1.0), Sampling(0.7, top_p=0.9, top_k=8)], ids=["T1", "T0.7-p0.9-k8"])
def test_with_the_same_seed_every_method_commits_ars_tokens(tiny_pair, sampling):
    """Each committed token is one draw from the target's own row, in the order ar draws it, and a walk draws on the
    rows it visits only: with the same generator seed every method commits exactly ar's tokens at T > 0 (fp32), not
    just tokens of the same distribution. bench's same_as_ar counts on it (docs/decoding.md).

    6 tokens a reply, not 10: the 20 replies still differ (20 and 19 of 20 at T1 and at the cuts) and the drafting
    methods accept 73 and 71 draft nodes (2026-12-07), in 2.4 s a case instead of 3.6 s on a 2-core AVX2 EPYC."""
    target, drafter = tiny_pair
    replies, accepted = set(), 0
    for seed in range(20):
        ar = generate(target, PROMPT, "ar", None, 8, 6, [], sampling, torch.Generator().manual_seed(seed)).new_tokens
        replies.add(tuple(ar))
        for method, options in (("dflash", {}), ("ddtree", {}), ("ddtree", {"lookup": 3, "redraft": 2})):
            result = generate(target, PROMPT, method, drafter, 8, 6, [], sampling, torch.Generator().manual_seed(seed),
                              **options)
            assert result.new_tokens == ar, (seed, method, options)
            accepted += sum(r.accepted_depth for r in result.rounds)
    assert len(replies) > 10 and accepted > 50  # sampled, and through accepted draft nodes, not the bonus token alone


@pytest.mark.parametrize("command", ["generate", "bench", "calibrate"])
def test_the_help_says_what_top_p_and_top_k_cut_and_in_which_order(command):
    """`--top-p TOP_P` and `--top-k TOP_K` stood in --help with no word of what they do (found in a review)."""
    from ddtree.arguments import build_parser

    subcommand = next(action for action in build_parser()._actions if action.dest == "command").choices[command]
    helps = {action.dest: action.help or "" for action in subcommand._actions}
    assert "T > 0" in helps["top_p"] and "after --top-k" in helps["top_p"] and "no cut" in helps["top_p"]
    assert "T > 0" in helps["top_k"] and "tied with the k-th" in helps["top_k"] and "before --top-p" in helps["top_k"]


@pytest.mark.parametrize("sampling", [Sampling(1.0, top_k=1), Sampling(2.0, top_p=1e-6)], ids=["top-k-1", "top-p-1e-6"])
def test_a_cut_to_the_likeliest_token_samples_the_argmax_in_every_method(tiny_pair, sampling):
    """Top-k 1, or a top-p below the likeliest token's mass, leaves the argmax alone at any temperature: every method
    then commits greedy decoding's tokens, the prefill's and every verified row's. (A walk that drew its rows without
    the top-k cut passed the tests above: ar walks the same rows, and at top-p 0.9 the cut to 8 of 12 tokens rarely
    bound.)"""
    target, drafter = tiny_pair
    greedy = hf_greedy(target, PROMPT, 6)
    for method, runner in (("ar", None), ("dflash", drafter), ("ddtree", drafter)):
        result = generate(target, PROMPT, method, runner, 8, 6, [], sampling, torch.Generator().manual_seed(0))
        assert result.new_tokens == greedy, method
