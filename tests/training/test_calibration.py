"""Calibration: per-position draft temperatures fitted on replayed validation rounds, carried to decoding and export.

The fit itself (the temperature the labels were drawn with is found) is tested in test_replay.py.

    OMP_NUM_THREADS=1 .venv/bin/python -m pytest tests/training/test_calibration.py -q
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

import toy_data  # tests/training/toy_data.py
from ddtree.bench import load_prompts, run_benchmark
from ddtree.cli import main as ddtree_main
from ddtree.corpus import CORPUS_FILE, CorpusLookup
from ddtree.decoding import DrafterRunner, generate
from ddtree.modeling_dflash import DFlashDraftModel
from ddtree.targets import build_drafter_config, load_target, stop_token_ids
from ddtree.tree import build_tree
import training.module
from training.checkpoints import drafter_from_checkpoint
from training.export import export_drafter
from training.arguments import RECIPES_DIR
from training.module import DistillModule
from training.recipe import RecipeSettingError, check_before_building, read_recipe
from training.replay import CALIBRATION_TEMPERATURES, replay_reply
from training.train import main as train_main
from rigged import hf_greedy  # tests/rigged.py


pytestmark = pytest.mark.usefixtures("undrawn_plots")  # tau.png drawn only where a test asks (drawn_plots)


def test_decoding_divides_the_draft_logits_by_the_temperatures_and_stays_lossless():
    target, tokenizer = load_target("tiny-random", torch.float32)
    torch.manual_seed(0)
    config = build_drafter_config(target, tokenizer, "tiny-random", num_layers=1, block_size=4)
    drafter = DFlashDraftModel(config).eval()
    prompt = tokenizer("def add(a, b):")["input_ids"]
    plain = DrafterRunner(drafter, target)
    greedy = hf_greedy(target, prompt, 12)

    out = target(torch.tensor([prompt]), output_hidden_states=True)
    context = plain.features(out.hidden_states)
    root = int(out.logits[0, -1].argmax())
    logits = plain.propose(root, len(prompt), context, 3)  # (3, V)

    drafter.config.draft_temperatures = [2.0, 0.5, 1.0]
    calibrated = DrafterRunner(drafter, target)
    scaled = calibrated.propose(root, len(prompt), context, 3)
    torch.testing.assert_close(scaled, logits / torch.tensor([[2.0], [0.5], [1.0]]))
    assert torch.equal(scaled.argmax(-1), logits.argmax(-1))  # the chain is unchanged
    assert build_tree(scaled, 8).expected_acceptance != build_tree(logits, 8).expected_acceptance
    for method in ("dflash", "ddtree"):  # whatever the temperatures, the target's own tokens
        result = generate(target, prompt, method, drafter=DrafterRunner(drafter, target), budget=8, max_new_tokens=12)
        assert result.new_tokens == greedy, method
    drafter.config.draft_temperatures = None
    assert "draft_temperatures" not in drafter.config.dflash_config


def test_model_calibrate_replays_the_rounds_decoding_runs_with_the_drafters_defaults(monkeypatch):
    """model.calibrate replayed its rounds without the drafter's context lookup, corpus and re-drafting, which
    decoding and model.replay_calibration use: on the CPU recipe's drafter 184 rounds where decoding ran 143, and
    temperatures fitted up to 2x apart from those of decoding's rounds."""
    torch.manual_seed(0)
    module = DistillModule(target="tiny-random", num_layers=1, block_size=4, num_anchors=4, lookup=5, redraft_prob=0.25,
                           target_dtype="float32")
    module.configure_model()
    target, drafter = module.target, module.base_drafter()
    assert drafter.config.lookup == 5 and drafter.config.redraft > 0  # decoding's defaults for this drafter
    prompt = [1, 5, 9, 13, 17, 21]
    max_new = 40
    reply = generate(target, prompt, "ar", max_new_tokens=max_new).new_tokens  # a random target's repeats: the lookup pays
    decoded = generate(target, prompt, "ddtree", DrafterRunner(drafter, target, calibrated=False), 8, max_new)
    bare = generate(target, prompt, "ddtree", DrafterRunner(drafter, target, calibrated=False), 8, max_new, lookup=0,
                    redraft=0)
    assert len(bare.rounds) != len(decoded.rounds)  # the defaults change the rounds here
    replayed, settings = [], []

    def recorded(*args, **kwargs):
        settings.append((kwargs["lookup"], kwargs["redraft"]))
        replayed.append(replay_reply(*args, **kwargs))
        return replayed[-1]

    monkeypatch.setattr(training.module, "replay_reply", recorded)
    loss_mask = torch.tensor([[0] * len(prompt) + [1] * len(reply)])
    batch = {"input_ids": torch.tensor([prompt + reply]), "loss_mask": loss_mask}
    temperatures = module.calibrate_draft_temperatures([batch], 8, max_new)
    assert [(r.accepted, r.committed) for r in replayed[0]] == [(r.accepted_depth, r.committed) for r in decoded.rounds]
    # With decoding's re-drafting too, whose blocks give a round's rows past depth 1 (calibrate_draft_temperatures);
    # on this random drafter it changes neither the rounds nor the fit, so only the setting shows it
    assert settings == [(5, drafter.config.redraft)]
    assert len(temperatures) == 3 and drafter.config.draft_temperatures == temperatures
    drafter.config.draft_temperatures = None


def test_model_calibrate_fits_the_rounds_of_every_rank():
    """Each rank replays its own share of the validation replies, and the temperatures are fitted on all ranks'
    rounds: the count of rounds that reached each depth is summed as the NLL is, so a depth only another rank's
    rounds reached is fitted on theirs, not left at 1 on this rank (whose drafter rank 0 then saves)."""
    module = DistillModule(target="tiny-random", num_layers=1, block_size=4, num_anchors=4, target_dtype="float32")
    module.configure_model()
    chosen = 2.0  # the other rank's rounds, at every depth, are likeliest at this temperature
    other_nll = torch.tensor([abs(t - chosen) for t in CALIBRATION_TEMPERATURES])[:, None].expand(-1, 4).clone()
    other_nll[:, 0] = 0  # (N, B); depth 0, the root, is never fitted
    other_counts = torch.tensor([0.0, 3.0, 2.0, 1.0])

    def reduce(value, reduce_op):  # this rank's sums plus the other rank's
        assert reduce_op == "sum"
        return value + (other_nll if value.dim() == 2 else other_counts)

    module._trainer = SimpleNamespace(strategy=SimpleNamespace(reduce=reduce))
    no_reply = {"input_ids": torch.tensor([[1, 5, 9, 13]]), "loss_mask": torch.zeros(1, 4, dtype=torch.long)}
    temperatures = module.calibrate_draft_temperatures([no_reply], 8, 8)  # this rank replays no round
    assert temperatures == pytest.approx([chosen] * 3)
    assert module.base_drafter().config.draft_temperatures == temperatures


def test_replayed_calibration_replays_each_row_with_its_own_reply(monkeypatch):
    """model.replay_calibration replays every validation row, each with its own loss mask: rows of one batch hold
    replies of their own lengths, and another row's mask would replay prompt tokens as reply, or cut the reply short."""
    module = DistillModule(target="tiny-random", num_layers=1, block_size=4, num_anchors=4, target_dtype="float32")
    module.configure_model()
    replayed = []

    class Replayed(Exception):
        pass

    def recorded(runner, sequences, *args):
        replayed.extend((ids.tolist(), mask.tolist()) for _, ids, mask in sequences)
        raise Replayed  # what is replayed is all this test reads

    monkeypatch.setattr(training.module, "learn_calibration", recorded)
    input_ids = torch.tensor([[1, 5, 9, 13, 17], [2, 6, 10, 14, 18]])
    loss_mask = torch.tensor([[0, 0, 1, 1, 1], [0, 0, 0, 0, 1]])
    with pytest.raises(Replayed):
        module.fit_replayed_calibration([{"input_ids": input_ids, "loss_mask": loss_mask}], 8, 8)
    assert replayed == [(input_ids[row].tolist(), loss_mask[row].tolist()) for row in range(2)]


def test_replayed_calibration_refuses_sampled_replies_and_notes_another_targets(tmp_path, capsys):
    """The replay takes every reply token for the target's greedy choice, and nothing read the data's record: a T=0.8
    copy of the shipped data trained with model.replay_calibration without a word, and the calibration written into
    the drafter expected tau 1.98 where T=0 decoding measured 2.36 (learned on greedy replies: 2.27 against 2.39)."""
    shipped = json.loads((RECIPES_DIR.parent / "data" / "smollm2-135m" / "regeneration.json").read_text())
    assert shipped["temperature"] == 0 and shipped["target"] == "smollm2-135m"
    sampled = tmp_path / "sampled"
    sampled.mkdir()
    (sampled / "regeneration.json").write_text(json.dumps({**shipped, "target": "tiny-random", "temperature": 0.8}))

    def checked(*overrides):
        config = read_recipe(RECIPES_DIR / "tiny.yaml", ["--trainer.precision=32-true", *overrides])
        capsys.readouterr()
        check_before_building(config)
        return capsys.readouterr().out.splitlines()

    for option in ("calibrate", "replay_calibration"):
        with pytest.raises(RecipeSettingError, match=rf"^model.{option} replays the validation replies as the target's "
                                                     rf"greedy decoding, and {sampled}/regeneration.json says they were "
                                                     rf"sampled at temperature 0.8: give data the target wrote at "
                                                     rf"temperature 0 \(data/regenerate.py's default\), or set "
                                                     rf"model.{option}=false$"):
            checked(f"--data.data_path={sampled}", f"--model.{option}=true")
    assert checked(f"--data.data_path={sampled}") == []  # nothing replayed: nothing to refuse
    with pytest.raises(RecipeSettingError, match=r"^model.calibrate and model.replay_calibration replay .* and "
                                                 r"data.regenerate says they were sampled at temperature 0.7: .* set "
                                                 r"model.calibrate=false and model.replay_calibration=false$"):
        checked("--data.data_path=auto", '--data.regenerate={"temperature": 0.7}', "--model.calibrate=true",
                "--model.replay_calibration=true")
    # Greedy replies of another target: the tiny recipe's own data, SmolLM2's replies replayed on tiny-random, a smoke
    # run that still runs, with one line saying so
    assert checked("--model.replay_calibration=true") == [
        "[calibration] model.replay_calibration replays the validation replies as tiny-random's greedy decoding, and "
        "data/smollm2-135m/regeneration.json says smollm2-135m wrote them: what it fits is measured on another "
        "model's text"]
    assert checked("--model.target=smollm2-135m", "--model.replay_calibration=true") == []  # the target's own


def test_replayed_calibration_of_auto_data_reads_data_regenerate_not_a_folder_named_auto(tmp_path, monkeypatch):
    """data.data_path "auto" names <ddtree cache>/data/<recipe>, which data.regenerate writes: an ./auto folder of
    sampled replies where the run is launched is another data set, and refusing the run for it named the wrong data."""
    (tmp_path / "auto").mkdir()
    (tmp_path / "auto" / "regeneration.json").write_text(json.dumps({"target": "tiny-random", "temperature": 0.8}))
    prompts = RECIPES_DIR.parent / "data" / "eval_prompts.jsonl"  # the recipe's, which it names from the repository
    monkeypatch.chdir(tmp_path)
    config = read_recipe(RECIPES_DIR / "tiny.yaml", ["--trainer.precision=32-true", "--data.data_path=auto",
                                                     '--data.regenerate={"temperature": 0}',
                                                     "--model.replay_calibration=true", f"--eval.prompts={prompts}"])
    check_before_building(config)  # greedy replies, as data.regenerate says: not refused


def test_replayed_calibration_reads_a_quoted_temperature_as_regenerate_does_and_refuses_one_that_is_no_number(tmp_path):
    """A temperature given as text ("0.8": regenerate.py's --temperature samples at 0.8) or one no one can read ("hot")
    was taken for greedy replies, and the replay calibrated on them without a word."""
    def check(*overrides):
        check_before_building(read_recipe(RECIPES_DIR / "tiny.yaml", ["--trainer.precision=32-true",
                                                                      "--model.calibrate=true", *overrides]))

    with pytest.raises(RecipeSettingError, match=r"data.regenerate says they were sampled at temperature 0.8: "):
        check("--data.data_path=auto", '--data.regenerate={"temperature": "0.8"}')
    for temperature, said in (("0.8", "says they were sampled at temperature 0.8: "),
                              ("hot", "gives temperature 'hot', not a number: ")):
        data = tmp_path / temperature
        data.mkdir()
        (data / "regeneration.json").write_text(json.dumps({"target": "tiny-random", "temperature": temperature}))
        with pytest.raises(RecipeSettingError, match=rf"^model.calibrate replays .* {data}/regeneration.json {said}"):
            check(f"--data.data_path={data}")
    (tmp_path / "greedy").mkdir()
    (tmp_path / "greedy" / "regeneration.json").write_text(json.dumps({"target": "tiny-random", "temperature": "0"}))
    check(f"--data.data_path={tmp_path / 'greedy'}")  # greedy, quoted: not refused


def test_calibration_with_no_validation_reply_to_replay_is_refused_before_the_run():
    """trainer.limit_val_batches 0 (or data.val_fraction 0) left the replay nothing: every evaluation printed "replayed
    on 0 validation batches", and the drafter exported with a calibration learned from nothing, recorded as
    calibrated."""
    for overrides, field in ((["--trainer.limit_val_batches=0", "--model.calibrate=true"],
                              "trainer.limit_val_batches=0"),
                             (["--data.val_fraction=0", "--model.replay_calibration=true"], "data.val_fraction=0.0")):
        config = read_recipe(RECIPES_DIR / "tiny.yaml", ["--trainer.precision=32-true", *overrides])
        option = overrides[1].removeprefix("--").removesuffix("=true")
        with pytest.raises(RecipeSettingError, match=rf"^{option} replays the validation replies, and {field} leaves "
                                                     rf"none to replay: give {field.split('=')[0]} above 0, or set "
                                                     rf"{option}=false$"):
            check_before_building(config)
    config = read_recipe(RECIPES_DIR / "tiny.yaml", ["--trainer.precision=32-true", "--trainer.limit_val_batches=0"])
    check_before_building(config)  # nothing replayed: validating nothing is the run's own choice


def test_replayed_calibration_reads_the_record_of_data_under_a_home_path(tmp_path, monkeypatch):
    """data.data_path ~/<folder> is read by the data module with ~ expanded; the launch checks took it literally, so
    a recipe's `data_path: ~/sampled` was refused as missing, and with that passed, its sampled replies never
    checked."""
    from ddtree.targets import cache_dir
    monkeypatch.setenv("DDTREE_CACHE", str(cache_dir()))
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "sampled").mkdir()
    (tmp_path / "sampled" / "regeneration.json").write_text(json.dumps({"target": "tiny-random", "temperature": 0.8}))
    config = read_recipe(RECIPES_DIR / "tiny.yaml", ["--trainer.precision=32-true", "--data.data_path=~/sampled",
                                                     "--model.calibrate=true"])
    record = f"{tmp_path}/sampled/regeneration.json"
    with pytest.raises(RecipeSettingError,
                       match=rf"^model.calibrate replays .* and {record} says they were sampled at temperature 0.8: "):
        check_before_building(config)


def calibrated_tiny_run(tmp_path, conversations: int, *settings: str) -> list[str]:
    """train.main arguments of a `tiny` run on toy conversations that calibrates before its evaluation every 2 steps."""
    data = toy_data.write_conversations(tmp_path / "conversations.jsonl", conversations, 30, 50, 0, with_ids=False)
    return [
        "--recipe", "tiny", "--output-root", str(tmp_path / "out"), "--run", "run",
        f"--data.data_path={data}", f"--data.cache_dir={tmp_path / 'cache'}", "--data.batch_size=2",
        "--data.val_fraction=0.25", "--trainer.val_check_interval=null", "--trainer.enable_progress_bar=false",
        "--model.calibrate=true", "--eval.every_n_train_steps=2", *settings,
    ]



def test_a_calibrated_run_evaluates_saves_and_exports_its_temperatures(tmp_path):
    args = calibrated_tiny_run(tmp_path, 16, "--trainer.max_steps=4", "--trainer.precision=32-true", "--eval.limit=2",
                               "--eval.max_new_tokens=8", "--checkpoint.save_top_k=-1")
    assert train_main(args) == 0
    run_dir = tmp_path / "out" / "tiny" / "run"
    target, tokenizer = load_target("tiny-random", torch.float32)
    prompts = load_prompts("data/eval_prompts.jsonl", tokenizer, limit=2)
    for step in (2, 4):
        evaluation = json.loads((run_dir / "eval" / f"step-{step:06d}.json").read_text())
        drafter = drafter_from_checkpoint(run_dir / "checkpoints" / f"step-{step}.ckpt")
        temperatures = drafter.config.draft_temperatures
        assert len(temperatures) == drafter.config.block_size - 1
        assert all(t in CALIBRATION_TEMPERATURES for t in temperatures)
        # the checkpoint holds the temperatures the evaluation decoded with: the same expected tau again
        summary = run_benchmark(target, DrafterRunner(drafter, target), prompts, ["ddtree"], [4, 8, 16], 8,
                                stop_token_ids(target, tokenizer), progress=False)["summary"]
        for key, stats in summary.items():
            assert evaluation["summary"][key]["expected_tau"] == pytest.approx(stats["expected_tau"], rel=1e-9), key
    exported = export_drafter(run_dir / "checkpoints" / "step-4.ckpt", tmp_path / "drafter")
    config = json.loads((exported / "config.json").read_text())
    assert config["dflash_config"]["draft_temperatures"] == temperatures


def test_calibration_runs_under_bf16_mixed(tmp_path):
    """bf16-mixed, as the CPU default recipe trains where bf16 is fast: the fit multiplies the drafter's fp32
    outputs by the bf16 target's LM head, which must happen under autocast (it crashed at the first evaluation)."""
    args = calibrated_tiny_run(tmp_path, 8, "--trainer.max_steps=2", "--trainer.precision=bf16-mixed", "--eval.limit=1",
                               "--eval.max_new_tokens=4")
    assert train_main(args) == 0
    drafter = drafter_from_checkpoint(tmp_path / "out" / "tiny" / "run" / "checkpoints" / "last.ckpt")
    temperatures = drafter.config.draft_temperatures
    assert len(temperatures) == drafter.config.block_size - 1 and all(t in CALIBRATION_TEMPERATURES for t in temperatures)



def test_a_replay_calibrated_run_decodes_saves_and_exports_what_it_learned(tmp_path, capsys):
    """model.replay_calibration: at each evaluation the chain and the tree are replayed over the validation replies
    with the drafter's lookups; what an OnlineCalibration learned from those rounds sits in the drafter's config, the
    evaluation decodes with it, the checkpoint and the export carry it, and decoders use it unless told none."""
    args = calibrated_tiny_run(tmp_path, 16, "--trainer.max_steps=4", "--trainer.precision=32-true", "--eval.limit=2",
                               "--eval.max_new_tokens=8", "--checkpoint.save_top_k=-1", "--model.calibrate=false",
                               "--model.replay_calibration=true", "--model.lookup=3", "--model.corpus=true")
    assert train_main(args) == 0
    assert "[calibration] replayed on 2 validation batches in " in capsys.readouterr().out
    run_dir = tmp_path / "out" / "tiny" / "run"
    target, tokenizer = load_target("tiny-random", torch.float32)
    prompts = load_prompts("data/eval_prompts.jsonl", tokenizer, limit=2)
    corpus = CorpusLookup.from_file(run_dir / CORPUS_FILE)
    learned = [drafter_from_checkpoint(run_dir / "checkpoints" / f"step-{step}.ckpt").config.calibration
               for step in (2, 4)]
    assert learned[0] != learned[1]  # each evaluation learned its own, for the weights it measured
    drafter = drafter_from_checkpoint(run_dir / "checkpoints" / "step-4.ckpt")
    learned = drafter.config.calibration
    assert set(learned["temperatures"]) == {"8", "chain"} and set(learned["graft_acceptance"]) <= {"context", "corpus"}
    assert any(learned["graft_acceptance"].values())  # the lookups grafted nodes in the replayed rounds
    assert drafter.config.draft_temperatures is None  # model.calibrate's, not asked for
    # the checkpoint holds what the evaluation decoded with: the same expected tau again, and another without it
    bench = lambda calibration: run_benchmark(  # noqa: E731
        target, DrafterRunner(drafter, target, corpus=corpus, calibration=calibration), prompts, ["ddtree"],
        [4, 8, 16], 8, stop_token_ids(target, tokenizer), progress=False)["summary"]
    calibrated, plain = bench(None), bench(False)
    evaluation = json.loads((run_dir / "eval" / "step-000004.json").read_text())
    assert evaluation["settings"]["calibrated"] is True  # the lookups' nodes counted by their replayed acceptance
    assert "counts the lookups' nodes by the drafter's own" not in (run_dir / "report.md").read_text()
    for key, stats in calibrated.items():
        assert evaluation["summary"][key]["expected_tau"] == pytest.approx(stats["expected_tau"], rel=1e-9), key
    assert any(plain[key]["expected_tau"] != stats["expected_tau"] for key, stats in calibrated.items())
    drafter_dir = run_dir / "drafter"
    assert json.loads((drafter_dir / "config.json").read_text())["dflash_config"]["calibration"] == learned
    capsys.readouterr()
    common = ["bench", "--target", "tiny-random", "--drafter", str(drafter_dir), "--prompts", "data/eval_prompts.jsonl",
              "--limit", "1", "--methods", "ddtree", "--budgets", "8", "--max-new-tokens", "6"]
    assert ddtree_main([*common, "--out", str(tmp_path / "with.json")]) == 0
    err = capsys.readouterr().err
    assert "[calibration] the drafter's config (replayed on its validation replies)" in err
    # It records what the replay decoded with, as calibration.json does, so that decoding otherwise is said: it was
    # silent, its grafts' tables priced for another lookup (found in a review)
    assert learned["decoded_with"] == {"lookup": 3, "redraft": 0, "corpus": True}
    assert "learned decoding with other settings" not in err
    assert ddtree_main([*common, "--lookup", "7"]) == 0
    assert "[calibration] note: learned decoding with other settings (lookup 3 here 7)" in capsys.readouterr().err
    assert ddtree_main([*common, "--calibration", "none", "--out", str(tmp_path / "without.json")]) == 0
    assert "[calibration]" not in capsys.readouterr().err
    resolved = [json.loads((tmp_path / f"{name}.json").read_text())["settings"]["calibration_resolved"]
                for name in ("with", "without")]
    assert resolved == ["the drafter's config (replayed)", None]
