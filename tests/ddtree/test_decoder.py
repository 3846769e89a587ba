"""ddtree.Decoder, decoding from Python: it decodes as `ddtree generate` does (the drafter folder's corpus and
calibration, the chat template, the stop tokens), commits the target's own tokens, and refuses bad keywords in one
line naming them."""

import json
import math
import re
import subprocess
import sys

import pytest
import torch

import ddtree.decoder
from ddtree import Decoder, Reply
from ddtree.calibration import CALIBRATION_FILE, OnlineCalibration, save_calibration
from ddtree.cli import main
from ddtree.decoder import measured_sizer, parse_device, progress_bars_off
from ddtree.corpus import CORPUS_FILE, write_replies
from ddtree.errors import DDTreeError
from ddtree.files import cache_dir
from ddtree.modeling_dflash import DFlashDraftModel
from ddtree.packed_linear import is_packed, packing_available
from ddtree.targets import build_drafter_config

TARGET = "tiny-random"
PROMPT = "Name two prime numbers."
SETTINGS = dict(dtype="float32", packed_weights="off", adaptive_size="off", budget=8)  # exact, and alike each run
# the reply length of the corpus tests: the grafted greedy reply's tau still clears the plain one's by more than 1 (it
# was 40, 1.7x the rounds: about 1.3 s more over the two tests on a 2-core AVX2 EPYC)
REPLY = 24


def with_temperatures(temperatures: dict) -> OnlineCalibration:
    """A calibration that divides the draft logits of each budget (None: any budget not named) by its temperature."""
    calibration = OnlineCalibration()
    calibration.log_temperatures = {budget: math.log(t) for budget, t in temperatures.items()}
    return calibration


@pytest.fixture
def drafter_folder(tmp_path, tiny_target):
    target, tokenizer = tiny_target
    torch.manual_seed(0)
    folder = tmp_path / "drafter"
    DFlashDraftModel(build_drafter_config(target, tokenizer, TARGET, num_layers=1)).save_pretrained(folder)
    return folder


def test_it_decodes_with_the_folders_corpus_as_the_command_does(capsys, tiny_target, drafter_folder):
    """The folder's corpus.safetensors is grafted by default, as `ddtree generate` grafts it: here the corpus holds the
    target's own greedy reply, which an untrained drafter would never guess, so it is what accepts drafts. The
    Python user who built a DrafterRunner by hand decoded without it (left alone in an earlier review)."""
    plain = Decoder(TARGET, **SETTINGS, quiet=True)
    ar = plain.generate(PROMPT, max_new_tokens=REPLY)
    assert isinstance(ar, Reply) and ar.result.rounds[0].tree_size == 0  # no drafter: plain decoding
    write_replies(drafter_folder / CORPUS_FILE, [ar.token_ids] * 3, tiny_target[1])

    decoder = Decoder(TARGET, drafter_folder, **SETTINGS)
    assert "[corpus] the drafter's corpus.safetensors: " in capsys.readouterr().err
    reply = decoder.generate(PROMPT, max_new_tokens=REPLY, lookup=0)
    # corpus=False neither reads the folder's corpus (seconds and memory for a large one) nor says it is in use
    # (mutation review, E07)
    without_corpus = Decoder(TARGET, drafter_folder, **SETTINGS, corpus=False)
    assert "[corpus]" not in capsys.readouterr().err and without_corpus.drafter.default_corpus is None
    without = without_corpus.generate(PROMPT, max_new_tokens=REPLY, lookup=0)
    # "none", as the command spells it, is none too: it was read as a file name, refused as "--corpus none"
    spelled = Decoder(TARGET, drafter_folder, **SETTINGS, corpus="none", quiet=True).generate(
        PROMPT, max_new_tokens=REPLY, lookup=0)
    assert reply.token_ids == without.token_ids == spelled.token_ids == ar.token_ids  # lossless, whatever the drafts
    assert reply.tau > without.tau + 1, (reply.tau, without.tau)  # the corpus grafted the reply
    assert spelled.tau == without.tau
    assert reply.text == tiny_target[1].decode(ar.token_ids, skip_special_tokens=True)

    code = main(["generate", "--target", TARGET, "--drafter", str(drafter_folder), "--prompt", PROMPT, "--no-stream",
                 "--max-new-tokens", str(REPLY), "--lookup", "0", "--budget", "8", "--dtype", "float32",
                 "--packed-weights", "off", "--adaptive-size", "off"])
    out, err = capsys.readouterr()
    assert code == 0 and out == reply.text + "\n"
    assert f"tau {reply.tau:.2f}" in err, err  # the same rounds


def test_corpus_true_is_the_folders_corpus(capsys, tiny_target, drafter_folder):
    """corpus=True asks for the corpus the folder ships, as None does: it is neither a file to read (a missing file
    named "True") nor a way to decode without it."""
    write_replies(drafter_folder / CORPUS_FILE, [[5, 6, 7, 8, 9, 10]] * 3, tiny_target[1])
    decoder = Decoder(TARGET, drafter_folder, **SETTINGS, corpus=True)
    assert "[corpus] the drafter's corpus.safetensors: " in capsys.readouterr().err
    assert decoder.drafter.default_corpus is not None


def test_it_decodes_with_the_folders_calibration(capsys, tiny_target, drafter_folder):
    """calibration.json in the folder shapes and prices the trees (the expected tau), unless calibration=False."""
    calibration = with_temperatures({None: 3.0, 8: 3.0})  # much warmer than the raw logits
    save_calibration(drafter_folder / CALIBRATION_FILE, calibration, {})
    decoder = Decoder(TARGET, drafter_folder, **SETTINGS)
    assert f"[calibration] {drafter_folder / CALIBRATION_FILE}: draft temperature" in capsys.readouterr().err
    shipped = decoder.drafter.default_calibration.state()
    raw = Decoder(TARGET, drafter_folder, **SETTINGS, calibration=False, quiet=True)
    assert raw.drafter.default_calibration is None
    assert Decoder(TARGET, drafter_folder, **SETTINGS, calibration="none", quiet=True).drafter.default_calibration is None
    for method in ("dflash", "ddtree"):
        # 12 tokens: every round's expectation is priced by the calibration, so a few rounds tell them apart
        calibrated, plain = (d.generate(PROMPT, method=method, max_new_tokens=12) for d in (decoder, raw))
        assert calibrated.token_ids == plain.token_ids
        expected = [sum(r.expected for r in reply.result.rounds) / len(reply.result.rounds)
                    for reply in (calibrated, plain)]
        assert expected[0] != pytest.approx(expected[1], abs=1e-6), (method, expected)
    # frozen: what the file holds, however many rounds it priced (else a prompt's trees hung on the ones before it)
    assert decoder.drafter.default_calibration.state() == shipped


def test_a_corpus_and_a_calibration_given_are_decoded_with(tiny_target, drafter_folder, tmp_path):
    """A corpus file and a calibration file given in place of the folder's: each could be read, said on stderr and then
    dropped, decoding with the folder's (none here) with every test passing (mutation review, D36-03, D36-02). The
    corpus holds the target's greedy reply, so grafting it raises tau; the tokens stay the target's."""
    greedy = Decoder(TARGET, **SETTINGS, quiet=True).generate(PROMPT, max_new_tokens=REPLY)
    write_replies(tmp_path / CORPUS_FILE, [greedy.token_ids] * 3, tiny_target[1])
    calibration = with_temperatures({None: 3.0, 8: 3.0})
    save_calibration(tmp_path / CALIBRATION_FILE, calibration, {})
    given = Decoder(TARGET, drafter_folder, **SETTINGS, corpus=tmp_path / CORPUS_FILE,
                    calibration=tmp_path / CALIBRATION_FILE, quiet=True)
    assert given.drafter.default_calibration.state() == calibration.state()
    folders = Decoder(TARGET, drafter_folder, **SETTINGS, quiet=True)
    reply, without = (decoder.generate(PROMPT, max_new_tokens=REPLY, lookup=0) for decoder in (given, folders))
    assert reply.token_ids == without.token_ids == greedy.token_ids
    assert reply.tau > without.tau + 1, (reply.tau, without.tau)


def test_calibration_false_leaves_out_the_calibration_the_config_holds(tiny_target, tmp_path):
    """A trained drafter's config holds a replayed calibration, used where its folder has no calibration.json; False
    leaves that out too, as `--calibration none` does. Read as None, it was decoded with anyway, with every test
    passing: the test folders' configs held none (mutation review, D36-01)."""
    target, tokenizer = tiny_target
    calibration = with_temperatures({None: 3.0, 8: 3.0})
    config = build_drafter_config(target, tokenizer, TARGET, num_layers=1)
    config.calibration = calibration.state()
    DFlashDraftModel(config).save_pretrained(tmp_path / "drafter")
    held = Decoder(TARGET, tmp_path / "drafter", **SETTINGS, quiet=True)
    assert held.drafter.calibration_from_config and held.drafter.default_calibration is not None
    for left_out in (False, "none"):
        assert Decoder(TARGET, tmp_path / "drafter", **SETTINGS, calibration=left_out,
                       quiet=True).drafter.default_calibration is None, left_out


def test_an_uncalibrated_runner_leaves_out_the_calibration_its_config_holds(tiny_target):
    """calibrated=False drafts the raw logits, to fit new temperatures from: had it kept the config's replayed
    calibration as its default, generate would have divided them by that calibration's temperatures anyway."""
    from ddtree.decoding import DrafterRunner

    target, tokenizer = tiny_target
    config = build_drafter_config(target, tokenizer, TARGET, num_layers=1)
    config.calibration = with_temperatures({None: 3.0, 8: 3.0}).state()
    drafter = DFlashDraftModel(config)
    assert DrafterRunner(drafter, target).default_calibration is not None
    raw = DrafterRunner(drafter, target, calibrated=False)
    assert raw.default_calibration is None and not raw.calibration_from_config


def test_a_broken_calibration_file_is_one_line_before_the_target_loads(monkeypatch, tmp_path, drafter_folder):
    """A calibration file given that cannot be read was read only once the target had loaded (the command reads it
    before); and the line, for a given file and the folder's own alike, told a Python caller to decode with
    `--calibration none`, a flag of the command, where a Decoder takes calibration=False."""
    broken = tmp_path / "broken.json"
    broken.write_text(json.dumps({"format_version": 1, "temperatures": {"8": -1.0}, "graft_acceptance": {}}))
    (drafter_folder / CALIBRATION_FILE).write_text(broken.read_text())
    with pytest.raises(DDTreeError) as raised:
        Decoder(TARGET, drafter_folder, **SETTINGS, quiet=True)
    assert str(raised.value).endswith("or decode with calibration=False"), str(raised.value)
    monkeypatch.setattr("ddtree.decoder.load_target", lambda *args, **kwargs: pytest.fail("loaded the target first"))
    with pytest.raises(DDTreeError) as raised:
        Decoder(TARGET, drafter_folder, **SETTINGS, calibration=broken, quiet=True)
    assert str(raised.value).startswith(f"calibration file {broken} cannot be read"), str(raised.value)
    assert str(raised.value).endswith("or decode with calibration=False"), str(raised.value)


def test_a_calibration_learned_on_other_weights_is_noted(capsys, tiny_target, drafter_folder):
    """The folder's calibration.json records the weights it was learned on; retrained weights copied in make its
    expected tau another drafter's, which is said, and only then. No Decoder test wrote the fingerprint, so the
    comparison could be turned around with every test passing (mutation review, D36-11)."""
    from ddtree.calibration import weights_fingerprint

    calibration = with_temperatures({8: 1.5})
    for weights, noted in ((weights_fingerprint(drafter_folder), False), ("learned on other weights", True)):
        save_calibration(drafter_folder / CALIBRATION_FILE, calibration, {"weights": weights})
        capsys.readouterr()
        Decoder(TARGET, drafter_folder, **SETTINGS)
        err = capsys.readouterr().err
        assert (f"was learned on other weights than {drafter_folder} holds now" in err) == noted, (weights, err)


def test_sampled_replies_follow_the_seed(tiny_target, drafter_folder):
    # 8 tokens: a random target's samples at another seed part within them, and ddtree's draws meet ar's over 8 as 16
    decoder = Decoder(TARGET, drafter_folder, **SETTINGS, quiet=True)
    first, again, other = (decoder.generate(PROMPT, max_new_tokens=8, temperature=1.0, seed=seed)
                           for seed in (3, 3, 4))
    assert first.token_ids == again.token_ids != other.token_ids
    ar = decoder.generate(PROMPT, method="ar", max_new_tokens=8, temperature=1.0, seed=3)
    assert ar.token_ids == first.token_ids  # the same draws of the target's distribution (docs/decoding.md)


def test_a_numpy_or_tensor_seed_samples_as_its_int_does(tiny_target):
    """check_seed takes a numpy int or a 0-d tensor as whole_number does, and torch's manual_seed then refused them: a
    TypeError (a RuntimeError for the tensor) once the target had loaded, in the Decoder and in its generate."""
    import numpy

    decoder, plain = (Decoder(TARGET, "random", **SETTINGS, seed=seed, quiet=True) for seed in (numpy.int64(2), 2))
    assert (decoder.generate(PROMPT, max_new_tokens=8, temperature=1.0).token_ids
            == plain.generate(PROMPT, max_new_tokens=8, temperature=1.0).token_ids)
    replies = [decoder.generate(PROMPT, max_new_tokens=8, temperature=1.0, seed=seed).token_ids
               for seed in (numpy.int64(3), torch.tensor(3), 3)]
    assert replies[0] == replies[1] == replies[2]


def test_a_numpy_float_temperature_and_top_p_are_numbers():
    """`temperature=np.float32(0.5)` was refused as "give a number", where top_k and seed take numpy ints."""
    import numpy

    decoder = Decoder(TARGET, **SETTINGS, quiet=True)
    sampled = [decoder.generate(PROMPT, max_new_tokens=8, temperature=temperature, top_p=top_p, seed=3).token_ids
               for temperature, top_p in ((numpy.float32(0.5), numpy.float32(0.75)), (0.5, 0.75))]
    assert sampled[0] == sampled[1]


def test_a_random_drafters_weights_follow_the_seed(tiny_target):
    """seed= seeds a random drafter's weights too (the docstring's promise); ignored, only tau and timings change,
    which no test saw (mutation review, E05)."""
    decoders = (Decoder(TARGET, "random", **SETTINGS, seed=seed, quiet=True) for seed in (1, 1, 2))
    first, again, other = (next(decoder.drafter.drafter.parameters()) for decoder in decoders)
    assert torch.equal(first, again) and not torch.equal(first, other)


def test_a_random_drafter_leaves_the_callers_random_numbers_as_they_were(tiny_target):
    """Its weights were drawn after torch.manual_seed(seed) on torch's global generator: a program's own draws after
    a Decoder(drafter="random") was built were seed 0's, whatever it had seeded or drawn before."""
    torch.manual_seed(123)
    expected = torch.rand(4)
    torch.manual_seed(123)
    Decoder(TARGET, "random", **SETTINGS, quiet=True)
    assert torch.equal(torch.rand(4), expected)


def test_token_ids_and_raw_text_prompts(tiny_target):
    decoder = Decoder(TARGET, **SETTINGS, quiet=True)
    ids = tiny_target[1]("def square(x):", add_special_tokens=False)["input_ids"]
    raw = decoder.generate("def square(x):", chat=False, max_new_tokens=8)
    assert raw.prompt_ids == ids and decoder.generate(ids, max_new_tokens=8).token_ids == raw.token_ids
    assert decoder.generate("def square(x):", max_new_tokens=8).prompt_ids != ids  # the chat template around it


def test_an_empty_raw_text_prompt_is_one_line():
    """With chat=False no template adds a token to the text: an empty prompt leaves the target nothing to continue
    from, and is refused naming chat=False rather than decoded from no tokens at all."""
    decoder = Decoder(TARGET, **SETTINGS, quiet=True)
    with pytest.raises(DDTreeError, match="prompt is empty, and with chat=False no chat template adds tokens to it"):
        decoder.generate("", chat=False, max_new_tokens=4)


def test_a_sized_decoder_decodes_ar_and_dflash_unsized(tiny_target):
    """The tree sizer measured for ddtree is handed to ddtree only: ar and dflash draw no tree, and a sizer handed to
    them is refused, so a Decoder with adaptive sizing could only decode ddtree."""
    decoder = Decoder(TARGET, "random", **{**SETTINGS, "adaptive_size": "on"}, static_cache="off", quiet=True)
    assert decoder.sizer is not None
    replies = [decoder.generate(PROMPT, method=method, max_new_tokens=8).token_ids for method in ("ar", "dflash")]
    assert replies[0] == replies[1] == decoder.generate(PROMPT, max_new_tokens=8).token_ids


def test_the_keywords_defaults_are_the_commands():
    """Each keyword is the `ddtree generate` flag of the same name, with its default; every test passed its own
    max_new_tokens, so generate's default could drift from the command's 256 (mutation review, E13)."""
    import inspect

    from ddtree.arguments import build_parser

    flags = vars(build_parser().parse_args(["generate", "--prompt", PROMPT]))
    # told apart on purpose: the command drafts with a random drafter unless told (a Decoder with none decodes plain),
    # its method is ddtree (a Decoder's follows its drafter), and a call without a seed draws on from the Decoder's
    apart = {"drafter", "method", "prompt", ("generate", "seed")}
    shared = [(function.__name__, name, parameter.default)
              for function in (Decoder.__init__, Decoder.generate)
              for name, parameter in inspect.signature(function).parameters.items()
              if name in flags and name not in apart and (function.__name__, name) not in apart]
    assert {"max_new_tokens", "temperature", "top_p", "top_k", "budget", "seed"} <= {name for _, name, _ in shared}
    assert [(where, name, default) for where, name, default in shared if default != flags[name]] == []


@pytest.mark.parametrize("keywords, named", [
    (dict(budget=0), "budget=0: give a whole number of tree nodes, at least 1"),
    (dict(budget=2.5), "budget=2.5: give a whole number"),
    (dict(adaptive_size="yes"), "adaptive_size='yes': choose one of 'auto', 'on', 'off'"),
    (dict(static_cache=True), "static_cache=True: choose one of 'auto', 'on', 'off'"),
    (dict(static_cache=None), "static_cache=None: choose one of 'auto', 'on', 'off'"),  # not a KeyError traceback
    (dict(corpus="replies.jsonl"), "corpus and calibration shape a drafter's trees, and no drafter was given"),
    (dict(drafter="no/such/folder"), "no/such/folder"),
    (dict(drafter="random", calibration="no-such.json"), "calibration='no-such.json': no such file"),
    # named as the command's flag, --corpus, where calibration= was named as the keyword (found in a review)
    (dict(drafter="random", corpus="no-such.jsonl"), "corpus=no-such.jsonl: no such file"),
    # "no such file" for a number, "corpus=.: a folder" for "" (the working folder)
    (dict(drafter="random", corpus=5), "corpus=5: give a JSONL file of conversations or a corpus.safetensors, as text"),
    (dict(drafter="random", corpus=""), "corpus='': give a JSONL file of conversations"),
    (dict(drafter="random", calibration=5), "calibration=5: give a file `ddtree calibrate` wrote, as text"),
    (dict(drafter="random", calibration=" "), "calibration=' ': give a file `ddtree calibrate` wrote"),
    (dict(device="tpu"), "device 'tpu' is not a device name"),
    # each found accepted, a traceback once the target had loaded, or a file read for nothing (mutation review, D36)
    (dict(device="mps"), "device mps: this code runs on a CPU or a CUDA GPU only"),
    (dict(device="cuda"), "device cuda: this machine has no CUDA GPU that torch can use"),
    (dict(calibration="calibration.json"), "corpus and calibration shape a drafter's trees, and no drafter was given"),
    (dict(seed=1.5), "seed=1.5: give a whole number from -2**63 to 2**64 - 1"),
    # said once the target had loaded (found in a review)
    (dict(dtype="bfloat16", packed_weights="on"), "packed_weights on: packing is for fp32 on a CPU, and the target "
                                                  "would run in bfloat16 on cpu"),
])
def test_bad_keywords_are_one_line_before_the_target_loads(monkeypatch, keywords, named):
    monkeypatch.setattr("ddtree.decoder.load_target", lambda *args, **kwargs: pytest.fail("loaded the target first"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # (device="cuda" on a machine with a GPU too)
    with pytest.raises(DDTreeError, match=None) as raised:
        Decoder(TARGET, **{"quiet": True, **keywords})
    assert named in str(raised.value) and "\n" not in str(raised.value), str(raised.value)


def test_a_corpus_and_a_calibration_under_home_are_read_as_the_command_reads_them(monkeypatch, tmp_path):
    """corpus="~/replies.jsonl" and calibration="~/calibration.json" were looked for under a folder named `~` ("no
    such file"), where `--corpus ~/...`, and the drafter= and target= keywords, take the home folder."""
    monkeypatch.setenv("DDTREE_CACHE", str(cache_dir()))  # the converted targets stay where they are
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "replies.jsonl").write_text(json.dumps({"messages": [{"role": "assistant", "content": "ok"}]}) + "\n")
    save_calibration(tmp_path / CALIBRATION_FILE, with_temperatures({8: 1.5}), {})

    class Loaded(Exception):
        pass

    def load_target(*args, **kwargs):
        raise Loaded  # every file was read without a word: the corpus was found

    monkeypatch.setattr("ddtree.decoder.load_target", load_target)
    with pytest.raises(Loaded):
        Decoder(TARGET, "random", corpus="~/replies.jsonl", calibration=f"~/{CALIBRATION_FILE}", quiet=True)


def test_a_gpu_index_is_checked_against_the_count_numbered_from_0(monkeypatch):
    """On a machine with 2 GPUs, cuda:2 is the first one it lacks: one line naming the count, not a torch error once
    the target had loaded; cuda:1, its last GPU, is taken."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert parse_device("cuda:1") == torch.device("cuda", 1)
    with pytest.raises(DDTreeError, match=r"^--device cuda:2: this machine has 2 CUDA GPU\(s\), numbered from 0$"):
        parse_device("cuda:2")


def test_a_cpu_index_other_than_0_is_refused():
    """torch takes cpu:1 as the one CPU device, so --device cpu:1 ran on every core as plain cpu, and bench recorded
    cpu:1 as if it had picked a CPU; cpu:0 is that same device, and is taken."""
    with pytest.raises(DDTreeError, match=r"^--device cpu:1: torch has one CPU device, .*; give --device cpu$"):
        parse_device("cpu:1")
    with pytest.raises(DDTreeError, match=r"^device cpu:3: .*; give device cpu$"):
        parse_device("cpu:3", "device")
    assert parse_device("cpu:0").type == parse_device("cpu").type == "cpu"


def test_bad_generate_keywords_are_one_line(tiny_target):
    plain = Decoder(TARGET, **SETTINGS, quiet=True)
    for keywords, named in ((dict(method="ddtree"), "method='ddtree' drafts with a drafter, and this Decoder has none"),
                            (dict(method="beam"), "unknown method 'beam'"),
                            (dict(temperature=-1), "temperature -1 must be a finite number >= 0"),
                            (dict(max_new_tokens=-1), "max_new_tokens -1 must be a whole number >= 0"),
                            (dict(chat=False, prompt=""), "prompt is empty, and with chat=False"),
                            # a string was true whatever it said: "false" applied the chat template
                            (dict(chat="false"), "chat='false': give True or False"),
                            (dict(online_calibration="no"), "online_calibration='no': give True or False"),
                            # the tokenizer's TypeError named neither the prompt nor the character (D36-13)
                            (dict(prompt="caf\udce9"), "prompt: not valid UTF-8 text (a lone surrogate, U+DCE9")):
        prompt = keywords.pop("prompt", PROMPT)
        with pytest.raises(DDTreeError) as raised:
            plain.generate(prompt, **keywords)
        assert named in str(raised.value), str(raised.value)
    drafting = Decoder(TARGET, "random", **SETTINGS, quiet=True)
    with pytest.raises(DDTreeError, match="online_calibration learns from a drafter's drafts"):
        drafting.generate(PROMPT, method="ar", online_calibration=True)
    # dflash drafts too, and the error above names it as one online_calibration works with: it is taken
    learned = drafting.generate(PROMPT, method="dflash", max_new_tokens=4, online_calibration=True)
    assert learned.token_ids == drafting.generate(PROMPT, method="ar", max_new_tokens=4).token_ids


def test_a_budget_of_one_node_decodes_the_greedy_reply(tiny_target):
    """budget=1, the least the keyword takes (its error says "at least 1"), is a tree of one drafted node a round:
    the smallest tree, and the reply is still the target's greedy one."""
    plain = Decoder(TARGET, None, **SETTINGS, quiet=True)
    decoder = Decoder(TARGET, "random", **{**SETTINGS, "budget": 1}, quiet=True)
    assert decoder.budget == 1
    assert decoder.generate(PROMPT, max_new_tokens=12).text == plain.generate(PROMPT, max_new_tokens=12).text


def test_a_budget_the_adaptive_size_cannot_time_names_the_keywords(capsys, tiny_target, tmp_path):
    """budget 2047 fits tiny-random's 2048 positions, but timing its 2048-row verifies leaves no room for a cached
    token: the Decoder's line named the command's flags (--budget, --adaptive-size off), which a Python user has not
    got."""
    with pytest.raises(DDTreeError) as raised:
        Decoder(TARGET, "random", **{**SETTINGS, "adaptive_size": "on", "budget": 2047}, static_cache="off", quiet=True)
    assert str(raised.value) == ("the target's context of 2048 positions leaves no room to time verifies of 2048 rows: "
                                 "give a lower budget=, or adaptive_size='off'")
    # past the context, refused when built, not at the first prompt's tree (mutation review, D36-07)
    with pytest.raises(DDTreeError, match="budget 5000: a tree of that many nodes cannot be verified within the "
                                          "target's context of 2048 tokens"):
        Decoder(TARGET, "random", **{**SETTINGS, "budget": 5000}, quiet=True)
    code = main(["generate", "--target", TARGET, "--drafter", "random", "--prompt", PROMPT, "--budget", "2047",
                 "--dtype", "float32", "--packed-weights", "off", "--adaptive-size", "on", "--static-cache", "off"])
    assert code != 0 and "lower --budget, or pass --adaptive-size off" in capsys.readouterr().err  # the command's
    (tmp_path / "prompts.jsonl").write_text(json.dumps({"prompt": PROMPT}) + "\n")
    code = main(["bench", "--target", TARGET, "--drafter", "random", "--prompts", str(tmp_path / "prompts.jsonl"),
                 "--budgets", "2047",
                 "--methods", "ddtree", "--dtype", "float32", "--packed-weights", "off", "--adaptive-size", "on",
                 "--static-cache", "off"])
    assert code != 0 and "lower --budgets, or pass --adaptive-size off" in capsys.readouterr().err  # bench's flag


def test_importing_ddtree_loads_no_torch():
    """The `ddtree` command answers --help before torch loads; the package's names load it when first named.
    A fresh interpreter checks the import alone (naming Decoder there loaded torch and transformers: 8 s on a 2-core
    AVX2 EPYC); this one, where they are loaded, that the names are ddtree.decoder's (`import ddtree.decoder` imports
    torch at its top)."""
    code = "import sys, ddtree; assert 'torch' not in sys.modules, 'torch on import'; print('no torch')"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "no torch", done.stderr
    assert ddtree.Decoder is ddtree.decoder.Decoder and ddtree.Reply is ddtree.decoder.Reply


def test_the_docs_example_runs(tiny_target, drafter_folder, monkeypatch):
    """docs/decoding.md's From Python example, as written, with the tiny target and a tiny drafter folder, each reply 8
    tokens long: its 64 and the default 256 (two calls) decoded 576 tokens, 13 s on a 2-core AVX2 EPYC, for calls
    whose keywords and results are what is checked."""
    from pathlib import Path

    docs = (Path(__file__).parents[2] / "docs" / "decoding.md").read_text()
    section = docs.split("## From Python")[1].split("\n## ")[0]
    example = section.split("```python\n")[1].split("```")[0]
    named = 'Decoder("smollm2-135m", drafter="outputs/smollm2-135m/<run>/drafter")'
    assert named in example
    example = example.replace(named, f"Decoder({TARGET!r}, drafter={str(drafter_folder)!r}, quiet=True)")
    example = example.replace("print(", "shown = (")
    example = re.sub(r"max_new_tokens=\d+", "max_new_tokens=8", example)
    monkeypatch.setitem(Decoder.generate.__kwdefaults__, "max_new_tokens", 8)
    namespace = {}
    exec(compile(example, "docs/decoding.md", "exec"), namespace)  # noqa: S102 (the project's own docs)
    assert isinstance(namespace["reply"], Reply) and namespace["reply"].token_ids
    assert len(namespace["reply"].token_ids) == 8  # shortened, as said above


def test_online_calibration_goes_on_learning_across_prompts(tiny_target, drafter_folder):
    """`ddtree generate --online-calibration` learns within one reply; a Decoder keeps its learner for the next.
    12-token replies: each prompt's rounds teach the learner something, which is all that is compared."""
    decoder = Decoder(TARGET, drafter_folder, **SETTINGS, quiet=True)
    first = decoder.generate(PROMPT, max_new_tokens=12, online_calibration=True)
    learned = dict(decoder._online.log_temperatures)
    assert learned  # it learned from the first reply's rounds
    second = decoder.generate("def square(x):", chat=False, max_new_tokens=12, online_calibration=True)
    alone = Decoder(TARGET, drafter_folder, **SETTINGS, quiet=True)  # the second prompt alone, from a fresh start
    alone.generate("def square(x):", chat=False, max_new_tokens=12, online_calibration=True)
    assert decoder._online.log_temperatures not in (learned, alone._online.log_temperatures)  # went on from there
    assert first.token_ids == decoder.generate(PROMPT, method="ar", max_new_tokens=12).token_ids
    assert second.token_ids == decoder.generate("def square(x):", chat=False, method="ar", max_new_tokens=12).token_ids


def test_a_calibrations_copy_learns_apart_from_the_one_it_copies():
    """--online-calibration learns from a copy of the drafter's calibration file: a copy that shared its tables would
    move the shipped temperatures too, and every later reply would start from this one's learning."""
    shipped = with_temperatures({8: 1.2})
    shipped.graft_rounds[("context", 1)], shipped.graft_accepted[("context", 1)] = 4, 3
    learner = shipped.copy()
    learner.log_temperatures[8] = 0.0
    learner.graft_rounds[("context", 1)] = learner.graft_accepted[("context", 1)] = 9
    assert shipped.log_temperatures == {8: math.log(1.2)}
    assert (shipped.graft_rounds, shipped.graft_accepted) == ({("context", 1): 4}, {("context", 1): 3})


def test_a_calibration_describes_its_temperatures_not_their_logarithms():
    """The line on stderr that names the calibration a decode uses: a log temperature would read 0.18 for 1.20."""
    assert with_temperatures({32: 1.2, None: 0.9}).describe() == "ddtree@32 1.20, chain 0.90"
    assert OnlineCalibration().describe() == "none"


def test_messages_with_a_system_prompt(tiny_target):
    """A list of messages (a system prompt, earlier turns) is rendered by the chat template, as bench renders a
    prompts file's {"messages"}; it was taken for token ids, and the error named prompt_ids (found in a review)."""
    from ddtree.bench import chat_prompt_ids

    decoder = Decoder(TARGET, **SETTINGS, quiet=True)
    messages = [{"role": "system", "content": "Answer in French."}, {"role": "user", "content": PROMPT}]
    reply = decoder.generate(messages, max_new_tokens=8)
    assert reply.prompt_ids == chat_prompt_ids(tiny_target[1], messages, "test", "")
    assert reply.prompt_ids != decoder.generate(PROMPT, max_new_tokens=8).prompt_ids  # the system prompt is in it
    for bad, named in (([{"role": "user"}], "prompt message 1 is not a"),
                       ([{"role": "user", "content": "Hi"}, 7], "prompt must be token ids"),
                       ({"text": "Hi"}, 'prompt is a mapping without "input_ids"')):
        with pytest.raises(DDTreeError) as raised:
            decoder.generate(bad)
        assert named in str(raised.value), str(raised.value)
    with pytest.raises(DDTreeError, match="prompt is a list of messages, which only a chat template renders"):
        decoder.generate(messages, chat=False)


def test_a_calibration_learned_with_other_settings_is_noted_once(capsys, tiny_target, drafter_folder):
    """`ddtree generate` notes a calibration learned with other lookups, re-drafting or sampling than it decodes with;
    the Decoder said nothing (found in a review of upgrades: an older `ddtree calibrate` file recorded redraft 4)."""
    calibration = with_temperatures({8: 1.5})
    save_calibration(drafter_folder / CALIBRATION_FILE, calibration,
                     {"decoded_with": {"lookup": 0, "redraft": 0, "corpus": False, "temperature": 0.0}})
    decoder = Decoder(TARGET, drafter_folder, **SETTINGS)
    capsys.readouterr()
    decoder.generate(PROMPT, max_new_tokens=8, lookup=0)
    assert "[calibration] note" not in capsys.readouterr().err  # decoded as learned
    for _ in range(2):
        decoder.generate(PROMPT, max_new_tokens=8, lookup=3)
    err = capsys.readouterr().err
    assert err.count("[calibration] note: learned decoding with other settings (lookup 0 here 3)") == 1, err
    decoder.generate(PROMPT, max_new_tokens=8, lookup=0, temperature=0.5)
    assert "(temperature 0.0 here 0.5)" in capsys.readouterr().err


def test_a_calibration_learned_with_the_folders_corpus_draws_no_note(capsys, tiny_target, drafter_folder):
    """`ddtree calibrate` learns with the folder's corpus by default; a default Decoder (corpus=None) decodes with it
    too, so no note is due. Compared with the corpus given (None) rather than the one decoded with, every such folder
    drew a false "expected tau will be off" (mutation review, E14)."""
    write_replies(drafter_folder / CORPUS_FILE, [tiny_target[1]("one two three four five six")["input_ids"]] * 3,
                  tiny_target[1])
    calibration = with_temperatures({8: 1.5})
    save_calibration(drafter_folder / CALIBRATION_FILE, calibration,
                     {"decoded_with": {"lookup": 0, "redraft": 0, "corpus": True, "temperature": 0.0}})
    for corpus, note in ((None, False), (False, True)):
        decoder = Decoder(TARGET, drafter_folder, **SETTINGS, corpus=corpus)
        capsys.readouterr()
        decoder.generate(PROMPT, max_new_tokens=8, lookup=0)
        err = capsys.readouterr().err
        assert ("[calibration] note: learned decoding with other settings (corpus True here False)" in err) == note, \
            (corpus, err)


def test_the_targets_notices_are_said_on_stderr_and_quiet_says_nothing(capsys, tiny_target):
    """The tiny target's 6 layers are too few for the published layer spread, which the random drafter's config says:
    it was printed on stdout, also by Decoder(quiet=True) (found in a review)."""
    capsys.readouterr()
    Decoder(TARGET, "random", **SETTINGS, quiet=True)
    out, err = capsys.readouterr()
    assert out == err == ""  # (transformers' own "Loading weights" bar too: test_quiet_silences_...)
    Decoder(TARGET, "random", **SETTINGS)
    out, err = capsys.readouterr()
    assert out == "" and "[ddtree] target tiny-random has 6 layers, too few for the published spread" in err


def test_quiet_silences_transformers_loading_bars_and_sets_them_back(capsys, tiny_target, drafter_folder):
    """Decoder(quiet=True) still drew transformers' "Loading weights" bar on stderr for the target and the drafter
    folder (left alone in an earlier review). quiet turns it off while they load, and leaves transformers' setting as
    it found it, on or off."""
    from transformers.utils import logging as hf_logging

    found = hf_logging.is_progress_bar_enabled()
    try:
        for bars in (True, False):
            (hf_logging.enable_progress_bar if bars else hf_logging.disable_progress_bar)()
            capsys.readouterr()
            Decoder(TARGET, drafter_folder, **SETTINGS, quiet=True)
            assert capsys.readouterr().err == "" and hf_logging.is_progress_bar_enabled() == bars
        hf_logging.enable_progress_bar()
        Decoder(TARGET, drafter_folder, **SETTINGS)
        assert "Loading weights" in capsys.readouterr().err  # not quiet: the bar as transformers draws it
    finally:
        (hf_logging.enable_progress_bar if found else hf_logging.disable_progress_bar)()


def test_paths_under_home_and_bad_values_found_in_a_review(monkeypatch, tmp_path, tiny_target, drafter_folder):
    """A `~` drafter path loaded the weights but looked for the folder's corpus and calibration under a folder named
    `~`; bad seeds, temperatures, callbacks and float token ids were tracebacks or went through cut."""
    monkeypatch.setenv("DDTREE_CACHE", str(cache_dir()))  # the converted targets stay where they are
    monkeypatch.setenv("HOME", str(drafter_folder.parent))
    write_replies(drafter_folder / CORPUS_FILE, [[5, 6, 7, 8]], tiny_target[1])
    decoder = Decoder(TARGET, "~/drafter", **SETTINGS, quiet=True)
    assert decoder.drafter.default_corpus is not None
    # (seed=None is a call's default now: it draws on from the Decoder's generator)
    for keywords, named in ((dict(seed=1.5), "seed=1.5: give a whole number from -2**63 to 2**64 - 1, or None to "
                                             "draw on from this Decoder's own seed"),
                            (dict(seed=True), "seed=True: give a whole number"),
                            (dict(seed=2**64), "seed=18446744073709551616"),
                            (dict(seed=-2**63 - 1), "seed=-9223372036854775809: give a whole number"),
                            (dict(temperature=None), "temperature=None: give a number"),
                            (dict(temperature=True), "temperature=True: give a number"),  # (sampled at 1.0: D36-10)
                            (dict(on_tokens=3), "on_tokens=3: give a function")):
        with pytest.raises(DDTreeError) as raised:
            decoder.generate(PROMPT, **keywords)
        assert named in str(raised.value), str(raised.value)
    with pytest.raises(DDTreeError, match="prompt must be token ids, whole numbers"):
        decoder.generate([1.5, 2.5])
    plain = Decoder(TARGET, **SETTINGS, quiet=True)
    with pytest.raises(DDTreeError, match="online_calibration learns from a drafter's drafts, and this Decoder has none"):
        plain.generate(PROMPT, online_calibration=True)
    monkeypatch.setattr("ddtree.decoder.load_target", lambda *args, **kwargs: pytest.fail("loaded the target first"))
    for keywords, named in ((dict(target=None), "target=None: give a name or a folder"),
                            (dict(packed_weights="yes"), "packed_weights='yes': choose one of"),
                            (dict(adaptive_size="on", static_cache="on"), "adaptive_size='on' saves nothing")):
        with pytest.raises(DDTreeError) as raised:
            Decoder(**{"target": TARGET, "quiet": True, **keywords})
        assert named in str(raised.value), str(raised.value)


def test_a_conversation_ending_with_a_reply_is_decoded_from_the_turn_before(capsys, tmp_path, tiny_target):
    """bench, calibrate and eval cut a conversation's trailing assistant turns (prompt_messages); the Decoder rendered
    them and opened a second assistant turn no user sends, without a word (found in a review of the edges)."""
    from ddtree.bench import read_prompts, tokenize_prompts

    messages = [{"role": "system", "content": "Answer in French."}, {"role": "user", "content": PROMPT},
                {"role": "assistant", "content": "2 and 3."}, {"role": "assistant", "content": "Also 5."}]
    held_out = tmp_path / "held_out.jsonl"
    held_out.write_text(json.dumps({"messages": messages}) + "\n")
    benched = tokenize_prompts(read_prompts(held_out), tiny_target[1])[0]["prompt_ids"]
    capsys.readouterr()
    decoder = Decoder(TARGET, **SETTINGS)
    capsys.readouterr()
    assert decoder.prompt_ids(messages) == benched == decoder.prompt_ids(messages[:2])
    assert "prompt ended with 2 assistant turns: cut, decoded from the turn before them" in capsys.readouterr().err
    with pytest.raises(DDTreeError) as raised:
        decoder.prompt_ids(messages[2:])
    assert str(raised.value) == ("prompt holds only assistant turns: give a conversation with a turn for the target "
                                 "to answer (a user's)")


def test_a_reply_cut_short_by_the_targets_context_says_so(capsys, tiny_target):
    """`ddtree generate` notes a reply the target's context cut short of max_new_tokens; the Decoder returned the short
    reply without a word, like one max_new_tokens had ended (found in a review of the edges). Why a reply ended is in
    its result now, and both say the line from it."""
    decoder = Decoder(TARGET, **SETTINGS)
    capsys.readouterr()
    near_the_end = tiny_target[1]("word " * 2040, add_special_tokens=False)["input_ids"][:2040]  # of 2048 positions
    reply = decoder.generate(near_the_end, method="ar", max_new_tokens=20)
    assert len(reply.token_ids) == 8 and not reply.result.stopped
    assert reply.ended == reply.result.ended == "context"
    assert ("[ar] stopped at the target's context of 2048 tokens (the prompt holds 2040), 12 short of max_new_tokens "
            "20: give a shorter prompt for a longer reply") in capsys.readouterr().err
    reply = decoder.generate(near_the_end, method="ar", max_new_tokens=8)  # all it asked for
    assert reply.ended == "max_new_tokens" and "stopped at the target's context" not in capsys.readouterr().err


def test_sampled_replies_differ_from_call_to_call_unless_seeded(tiny_target):
    """generate's seed defaulted to 0 on every call, so a Decoder asked again (best of n) gave the same sample each
    time (found in a review of the edges). Without a seed, calls draw on from the Decoder's generator, seeded once
    from its constructor's seed: calls differ, runs of a script repeat; a seed reseeds that call alone."""
    samples = []
    for _ in range(2):  # two runs of one script
        decoder = Decoder(TARGET, **SETTINGS, quiet=True)
        samples.append([tuple(decoder.generate(PROMPT, max_new_tokens=8, temperature=1.0).token_ids)
                        for _ in range(4)])
    assert samples[0] == samples[1] and len(set(samples[0])) > 1, samples
    other = Decoder(TARGET, **SETTINGS, seed=1, quiet=True)
    assert [tuple(other.generate(PROMPT, max_new_tokens=8, temperature=1.0).token_ids) for _ in range(4)] != samples[0]
    seeded = [decoder.generate(PROMPT, max_new_tokens=8, temperature=1.0, seed=3).token_ids for _ in range(2)]
    assert seeded[0] == seeded[1]
    after = decoder.generate(PROMPT, max_new_tokens=8, temperature=1.0).token_ids  # the seeded calls drew none of its
    fresh = Decoder(TARGET, **SETTINGS, quiet=True)
    assert after == [fresh.generate(PROMPT, max_new_tokens=8, temperature=1.0).token_ids for _ in range(5)][-1]


def test_a_reply_ends_at_a_stop_token_in_the_decoder_and_the_command(capsys, monkeypatch, tiny_target):
    """The tiny target never says its end-of-turn token, and no test of the Decoder or the command decoded a reply
    that ends at one: either could drop the stop ids with every test passing, while SmolLM2's replies ran on past the
    end of the turn, inventing the next ones (mutation review, D01 and C04). A token of the greedy reply stops it here."""
    greedy = Decoder(TARGET, **SETTINGS, quiet=True).generate(PROMPT, chat=False, max_new_tokens=20).token_ids
    stop = next(token for token in greedy if token != greedy[0])  # (the tiny target repeats a token, then another)
    ends = greedy.index(stop) + 1
    assert 1 < ends < 20, greedy
    monkeypatch.setattr("ddtree.decoder.stop_token_ids", lambda target, tokenizer: [stop])
    decoder = Decoder(TARGET, **SETTINGS, quiet=True)
    reply = decoder.generate(PROMPT, chat=False, max_new_tokens=20)
    assert decoder.stop_ids == [stop] and reply.ended == "stop" and reply.token_ids == greedy[:ends]
    monkeypatch.setattr("ddtree.cli.stop_token_ids", lambda target, tokenizer: [stop])
    code = main(["generate", "--target", TARGET, "--method", "ar", "--raw", "--prompt", PROMPT, "--no-stream",
                 "--max-new-tokens", "20", "--dtype", "float32", "--packed-weights", "off"])
    out, err = capsys.readouterr()
    assert code == 0 and out == reply.text + "\n" and f"[ar] {ends} tokens" in err, err


def test_a_reply_ending_at_the_end_of_turn_token_leaves_it_out_of_the_text(capsys, monkeypatch, tiny_target):
    """Every SmolLM2 reply ends at `<|im_end|>`, which the tiny target never says: Reply.text and `--no-stream` could
    keep it with every test passing (mutation review, E12, C15). The target is rigged to say it where its greedy reply
    says its second token."""
    from ddtree.targets import load_target

    tokenizer = tiny_target[1]
    end_of_turn = tokenizer.convert_tokens_to_ids("<|im_end|>")
    greedy = Decoder(TARGET, **SETTINGS, quiet=True).generate(PROMPT, chat=False, max_new_tokens=20).token_ids
    swapped = next(token for token in greedy if token != greedy[0])  # (the tiny target repeats a token, then another)

    def rigged(*args, **kwargs):
        target, tokenizer = load_target(*args, **kwargs)

        def say_end_of_turn(module, inputs, logits):  # (B, T, V): where `swapped` would win, the end of turn does
            wins = logits.argmax(-1, keepdim=True) == swapped
            return logits.scatter(-1, torch.full_like(wins, end_of_turn, dtype=torch.long),
                                  torch.where(wins, logits.amax(-1, keepdim=True) + 1, logits.amin(-1, keepdim=True)))

        target.get_output_embeddings().register_forward_hook(say_end_of_turn)
        return target, tokenizer

    monkeypatch.setattr("ddtree.decoder.load_target", rigged)
    monkeypatch.setattr("ddtree.cli.load_target", rigged)
    reply = Decoder(TARGET, **SETTINGS, quiet=True).generate(PROMPT, chat=False, max_new_tokens=20)
    ends = greedy.index(swapped) + 1
    assert reply.ended == "stop" and reply.token_ids == greedy[:ends - 1] + [end_of_turn], (reply.token_ids, greedy)
    assert "<|im_end|>" not in reply.text and reply.text == tokenizer.decode(greedy[:ends - 1])
    code = main(["generate", "--target", TARGET, "--method", "ar", "--raw", "--prompt", PROMPT, "--no-stream",
                 "--max-new-tokens", "20", "--dtype", "float32", "--packed-weights", "off"])
    out, err = capsys.readouterr()
    assert code == 0 and out == reply.text + "\n" and f"[ar] {ends} tokens" in err, err


@pytest.mark.skipif(not packing_available(), reason="this torch has no oneDNN weight packing")
def test_packed_weights_on_packs_the_target_and_the_drafter(tiny_target):
    """Every other Decoder test decodes with packed_weights="off", so "on" could be ignored, or the drafter left on
    plain layers behind a packed target, with every test passing (mutation review, D07, D08). The tokens are the
    same."""
    settings = {**SETTINGS, "packed_weights": "on"}
    packed = Decoder(TARGET, "random", **settings, quiet=True)
    plain = Decoder(TARGET, "random", **SETTINGS, quiet=True)
    assert is_packed(packed.target) and is_packed(packed.drafter.drafter)
    assert not is_packed(plain.target) and not is_packed(plain.drafter.drafter)
    assert packed.generate(PROMPT, max_new_tokens=8).token_ids == plain.generate(PROMPT, max_new_tokens=8).token_ids


def test_top_k_and_top_p_cut_what_is_sampled(tiny_target):
    """At temperature 1, top_k=1 and a tiny top_p leave the likeliest token alone: greedy decoding. No Decoder test
    passed either, so both could be dropped before decoding, sampling from the uncut distribution (mutation review,
    D03)."""
    decoder = Decoder(TARGET, **SETTINGS, quiet=True)
    greedy = decoder.generate(PROMPT, chat=False, max_new_tokens=12).token_ids
    sampled = dict(chat=False, max_new_tokens=12, temperature=1.0, seed=3)
    assert decoder.generate(PROMPT, **sampled).token_ids != greedy  # uncut, this seed samples another reply
    for cut in (dict(top_k=1), dict(top_p=1e-6)):
        assert decoder.generate(PROMPT, **sampled, **cut).token_ids == greedy, cut


def test_on_tokens_hears_each_rounds_committed_tokens(tiny_target):
    """Only a non-callable on_tokens was tested, so the callback could be dropped and a streaming caller heard nothing
    (mutation review, D02)."""
    decoder = Decoder(TARGET, "random", **SETTINGS, quiet=True)
    heard = []
    reply = decoder.generate(PROMPT, max_new_tokens=12, on_tokens=heard.append)
    assert [token for tokens in heard for token in tokens] == reply.token_ids
    assert len(heard) == len(reply.result.rounds) + 1  # the prefill's token, then each round's


def test_a_default_decoder_on_a_cpu_sizes_budget_32_trees(sized_rows, tiny_target):
    """The docs say a Decoder on a CPU verifies trees sized to the verify cost measured at load; its defaults could
    turn that off, or change the published budget 32, with every test passing (mutation review, D05, D06). The
    measurement is stubbed: what is checked is that it is asked for, and for which rows."""
    from ddtree.sizing import TreeSizer

    decoder = Decoder(TARGET, "random", dtype="float32", device="cpu", packed_weights="off", quiet=True)
    assert decoder.budget == 32 and isinstance(decoder.sizer, TreeSizer) and sized_rows == [33]  # the root is a row
    static = Decoder(TARGET, "random", dtype="float32", device="cpu", packed_weights="off", static_cache="on", quiet=True)
    assert static.sizer is None and sized_rows == [33]  # every verify runs budget + 1 rows: nothing to size


def test_a_random_drafter_takes_the_targets_dtype(tiny_target):
    """A random drafter is cast to the target's dtype and device: built in fp32 beside a bf16 target, it drafted
    from bf16 features in fp32 at twice the memory, which no test saw (every one decoded in fp32; mutation review 63,
    dec1)."""
    decoder = Decoder(TARGET, "random", **{**SETTINGS, "dtype": "bfloat16"}, quiet=True)
    drafter = decoder.drafter.drafter
    assert decoder.target.dtype == drafter.dtype == torch.bfloat16
    assert drafter.device == decoder.target.device and not drafter.training


def test_a_quiet_block_sets_transformers_and_the_hubs_bars_back_each_as_found():
    """progress_bars_off turns both off for its block and sets each back as it was, though transformers' switch flips
    the Hub's too. A Decoder runs it twice (target, drafter), so a set-back turned around cancelled out in
    test_quiet_silences_...: called once here, in each of the four states (mutation review 63, dec6, dec7)."""
    from huggingface_hub.utils import are_progress_bars_disabled, disable_progress_bars, enable_progress_bars
    from transformers.utils import logging as hf_logging

    found = hf_logging.is_progress_bar_enabled(), not are_progress_bars_disabled()
    try:
        for bars, hub_bars in ((True, True), (True, False), (False, True), (False, False)):
            (hf_logging.enable_progress_bar if bars else hf_logging.disable_progress_bar)()
            (enable_progress_bars if hub_bars else disable_progress_bars)()
            with progress_bars_off(True):
                assert not hf_logging.is_progress_bar_enabled() and are_progress_bars_disabled()
            assert (hf_logging.is_progress_bar_enabled(), not are_progress_bars_disabled()) == (bars, hub_bars)
    finally:
        (hf_logging.enable_progress_bar if found[0] else hf_logging.disable_progress_bar)()
        (enable_progress_bars if found[1] else disable_progress_bars)()


def test_adaptive_size_auto_measures_for_ddtree_only(tiny_target):
    """`auto` sizes ddtree trees over the dynamic cache and leaves every other method unsized; measured for `ar` or
    dflash, `ddtree generate --method ar --adaptive-size auto` was refused as if sizing had been asked of it
    (mutation review 63, dec4)."""
    target, _ = tiny_target
    lines = []
    for method in ("ar", "dflash"):
        assert measured_sizer("auto", False, target, 8, method, lines.append, "pass --adaptive-size off") is None
    assert lines == []
    assert measured_sizer("auto", False, target, 8, "ddtree", lines.append, "pass --adaptive-size off") is not None
    assert len(lines) == 1 and lines[0].startswith("[adaptive size]") and "(measured up to 9 rows)" in lines[0]


def test_a_calibration_learned_with_adaptive_size_on_and_no_redraft_draws_no_note(capsys, tiny_target, tmp_path):
    """Sized trees re-draft nothing by default (drafter_defaults), so a drafter whose config re-drafts 2, calibrated
    with adaptive size on, was learned with redraft 0 as it decodes: the note compared with the config's 2 instead,
    and said a false "expected tau will be off" (mutation review 63, dec11)."""
    target, tokenizer = tiny_target
    torch.manual_seed(0)
    config = build_drafter_config(target, tokenizer, TARGET, num_layers=1)
    config.redraft = 2
    DFlashDraftModel(config).save_pretrained(tmp_path / "drafter")
    save_calibration(tmp_path / "drafter" / CALIBRATION_FILE, with_temperatures({8: 1.5}),
                     {"decoded_with": {"lookup": 0, "redraft": 0, "corpus": False, "temperature": 0.0}})
    for adaptive_size, note in (("on", False), ("off", True)):
        decoder = Decoder(TARGET, tmp_path / "drafter", **{**SETTINGS, "adaptive_size": adaptive_size},
                          static_cache="off")
        capsys.readouterr()
        decoder.generate(PROMPT, max_new_tokens=8)
        err = capsys.readouterr().err
        assert ("[calibration] note: learned decoding with other settings (redraft 0 here 2)" in err) == note, \
            (adaptive_size, err)
