"""--packed-weights (ddtree/packed_linear.py): oneDNN's matmul over weights packed once, for decoding on a CPU."""

import io
from types import SimpleNamespace

import pytest
import torch
from torch import nn

import ddtree.packed_linear as packed_linear
from ddtree.errors import DDTreeError
from ddtree.packed_linear import apply_packing, check_packing_choice, is_packed, pack_linears, unpack_linears

needs_packing = pytest.mark.skipif(not packed_linear.packing_available(), reason="this torch has no oneDNN packing")


def frozen(module: nn.Module) -> nn.Module:
    return module.eval().requires_grad_(False)


def two_layers(bias: bool = True) -> nn.Module:
    torch.manual_seed(0)
    return frozen(nn.Sequential(nn.Linear(24, 40, bias=bias), nn.GELU(), nn.Linear(40, 7, bias=bias)))


@needs_packing
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("shape", [(1, 24), (2, 24), (17, 24), (1, 5, 24), (3, 33, 24)])
def test_packed_layers_compute_what_plain_ones_do(bias, shape):
    model = two_layers(bias)
    x = torch.randn(*shape)
    plain = model(x)
    assert pack_linears(model) == 2 and is_packed(model)
    packed = model(x)
    assert packed.shape == plain.shape
    torch.testing.assert_close(packed, plain, rtol=1e-5, atol=1e-5)


@needs_packing
def test_a_non_contiguous_input_is_accepted():
    model = two_layers()
    x = torch.randn(24, 6).t()  # (6, 24), strided
    plain = model(x)
    pack_linears(model)
    torch.testing.assert_close(model(x), plain, rtol=1e-5, atol=1e-5)


@needs_packing
def test_the_packed_path_is_the_one_that_runs(monkeypatch):
    model = two_layers()
    pack_linears(model)
    calls = []
    real = torch.ops.mkldnn._linear_pointwise

    class Spy:
        def __call__(self, *args):
            calls.append(args[0].shape)
            return real(*args)

    monkeypatch.setattr(packed_linear.torch.ops.mkldnn, "_linear_pointwise", Spy(), raising=False)
    model(torch.randn(3, 24))
    assert calls == [torch.Size([3, 24]), torch.Size([3, 40])]


@needs_packing
def test_autograd_other_dtypes_and_changed_weights_take_the_plain_path():
    model = two_layers()
    pack_linears(model)
    layer = model[0]
    x = torch.randn(4, 24, requires_grad=True)
    out = layer(x)  # recording autograd: F.linear, which has a backward
    out.sum().backward()
    assert torch.equal(out, torch.nn.functional.linear(x, layer.weight, layer.bias))
    assert x.grad is not None
    with torch.no_grad():
        layer.weight.mul_(2)  # changed in place after packing: repacked, so the output follows the new weight
    y = torch.randn(4, 24)
    torch.testing.assert_close(layer(y), torch.nn.functional.linear(y, layer.weight, layer.bias), rtol=1e-5, atol=1e-5)


@needs_packing
def test_a_packed_layer_whose_weight_is_made_trainable_again_passes_gradients_to_it():
    """A packed model set to train (`requires_grad_(True)`) with inputs that need no gradient, as a first layer's
    embeddings: the packed op sees only the packed copy, so run packed the weight would get no gradient, silently."""
    model = two_layers()
    pack_linears(model)
    layer, x = model[0], torch.randn(4, 24)
    layer.requires_grad_(True)
    layer(x).sum().backward()
    torch.testing.assert_close(layer.weight.grad, x.sum(0).expand(40, 24))
    torch.testing.assert_close(layer.bias.grad, torch.full((40,), 4.0))


@needs_packing
def test_a_weight_whose_storage_was_swapped_is_repacked():
    """`.data = ...` and a dtype round trip give the weight new storage with the same version count."""
    model = two_layers()
    pack_linears(model)
    layer, y = model[0], torch.randn(4, 24)
    layer.weight.data = torch.randn_like(layer.weight)
    torch.testing.assert_close(layer(y), torch.nn.functional.linear(y, layer.weight, layer.bias), rtol=1e-5, atol=1e-5)
    model.to(torch.bfloat16).to(torch.float32)  # rounded to bf16 and back: other values, other storage
    torch.testing.assert_close(layer(y), torch.nn.functional.linear(y, layer.weight, layer.bias), rtol=1e-5, atol=1e-5)


@needs_packing
def test_a_packed_model_moved_to_another_dtype_runs_plain():
    model = two_layers()
    pack_linears(model)
    model.double()  # the packed fp32 copies no longer apply
    x = torch.randn(3, 24, dtype=torch.float64)
    out = model(x)
    assert out.dtype == torch.float64
    expected = model[2](model[1](torch.nn.functional.linear(x, model[0].weight, model[0].bias)))
    assert torch.equal(out, expected)


@needs_packing
def test_unpack_restores_the_plain_layers_and_ties_survive_packing():
    torch.manual_seed(0)
    embedding = nn.Embedding(50, 16)
    head = nn.Linear(16, 50, bias=False)
    head.weight = embedding.weight  # tied, as a small LM's head and embedding are
    model = frozen(nn.ModuleDict({"embed": embedding, "head": head}))
    assert pack_linears(model) == 1
    assert model["head"].weight is model["embed"].weight  # packing adds a copy; the parameter is untouched
    assert set(dict(model.named_parameters())) == {"embed.weight"}
    assert "_ddtree_packed" not in str(list(model.state_dict()))
    assert unpack_linears(model) == 1 and not is_packed(model)
    assert "forward" not in vars(model["head"])


def test_a_weight_shared_by_two_layers_is_counted_once():
    # linear_bytes sizes the packed copy auto weighs against free memory: a tie is one weight, not two
    first, second = nn.Linear(16, 8, bias=False), nn.Linear(16, 8, bias=False)
    second.weight = first.weight
    assert packed_linear.linear_bytes(frozen(nn.Sequential(first, second))) == 16 * 8 * 4  # (8, 16) fp32


@needs_packing
def test_packing_a_packed_model_again_packs_nothing():
    model = two_layers()
    assert pack_linears(model) == 2
    copies = [layer._ddtree_packed for layer in (model[0], model[2])]
    assert pack_linears(model) == 0
    assert [layer._ddtree_packed for layer in (model[0], model[2])] == copies  # the same objects, not packed again


def test_trainable_and_non_fp32_layers_are_left_alone():
    trainable = nn.Linear(8, 8)  # requires_grad: a model being trained is never packed
    half = frozen(nn.Linear(8, 8)).to(torch.bfloat16)
    assert pack_linears(nn.Sequential(trainable, half)) == 0


@needs_packing
def test_auto_packs_where_the_packed_layers_measured_faster(monkeypatch):
    model = two_layers()
    assert apply_packing("off", model) == (False, "")
    monkeypatch.setattr(packed_linear, "measure_packing", lambda probe: (10.0, 5.0))
    pack, line = apply_packing("auto", model)
    assert pack and line.startswith("[packed weights] on") and "5.0 ms packed, 10.0 plain" in line
    assert "(0.50x of plain; auto packs below 0.9x; " in line  # the rule the figures were judged by
    assert is_packed(model)
    model = two_layers()
    monkeypatch.setattr(packed_linear, "measure_packing", lambda probe: (10.0, 9.5))  # not faster by enough
    pack, line = apply_packing("auto", model)
    assert not pack and line.startswith("[packed weights] off") and "--packed-weights on packs anyway" in line
    # packed was faster, yet off: the line said so without the 0.9x that decides (found in a review)
    assert "9.5 ms packed, 10.0 plain (0.95x of plain; auto packs below 0.9x); --packed-weights on" in line
    assert not is_packed(model)  # measured packed, then unpacked


@needs_packing
def test_measure_packing_times_the_models_layers_both_ways(monkeypatch):
    import time

    model = two_layers()
    assert pack_linears(model) == 2
    plain, fast = packed_linear.measure_packing(model)
    assert plain > 0 and fast > 0
    # Each figure times its own path: plain F.linear made 5 ms slower a call (2 layers x 2 probe shapes) puts the
    # plain figure at 20 ms or more and leaves the packed one, which never calls it, at its own. Bounds on the figures
    # alone: plain + 19 failed under load with 2 threads, where the unslowed plain figure itself grew to ~14 ms.
    linear = packed_linear.F.linear
    monkeypatch.setattr(packed_linear.F, "linear", lambda *args: time.sleep(0.005) or linear(*args))
    slowed, packed = packed_linear.measure_packing(model)
    assert slowed >= 20 and packed < 15, (plain, fast, slowed, packed)


@needs_packing
def test_measure_packing_keeps_the_best_of_its_repeats(monkeypatch):
    # A fake clock: plain runs take 5, 2, 9 ms and packed ones 4, 1, 3 (measured alternately); a late slow repeat
    # (another process on the cores) must not become the figure auto decides on
    model = two_layers()
    pack_linears(model)
    durations = [5, 4, 2, 1, 9, 3]  # plain, packed, plain, packed, ...
    ticks = iter([tick for i, ms in enumerate(durations) for tick in (100.0 * i, 100.0 * i + ms / 1000)])
    monkeypatch.setattr(packed_linear, "time", SimpleNamespace(perf_counter=lambda: next(ticks)))
    plain, packed = packed_linear.measure_packing(model)
    assert (round(plain, 6), round(packed, 6)) == (2, 1)


@needs_packing
def test_auto_leaves_a_packed_copy_that_would_crowd_memory(monkeypatch):
    model = two_layers()
    monkeypatch.setattr(packed_linear, "measure_packing", lambda probe: (10.0, 5.0))
    monkeypatch.setattr(packed_linear, "available_memory_bytes", lambda: 4 * packed_linear.linear_bytes(model) - 1)
    pack, line = apply_packing("auto", model)
    assert not pack and "over a quarter" in line and "--packed-weights on" in line
    assert apply_packing("on", model)[0]  # on packs even so


def test_available_memory_is_counted_in_bytes_and_only_what_is_free(monkeypatch):
    """apply_packing weighs a packed copy's bytes against it, and no test read it unpatched (mutation review 63):
    /proc/meminfo counts kB, which taken as bytes refused `auto` packing on any machine; where it cannot be read,
    the free pages count, not every page the machine has."""
    meminfo = "MemTotal:    4096 kB\nMemFree:     512 kB\nMemAvailable:    1024 kB\n"
    monkeypatch.setattr(packed_linear, "open", lambda path: io.StringIO(meminfo), raising=False)
    assert packed_linear.available_memory_bytes() == 1024 * 1024

    def unreadable(path):
        raise OSError(f"{path}: no such file")

    monkeypatch.setattr(packed_linear, "open", unreadable, raising=False)
    pages = {"SC_AVPHYS_PAGES": 10, "SC_PHYS_PAGES": 100, "SC_PAGE_SIZE": 4096}
    monkeypatch.setattr(packed_linear.os, "sysconf", pages.__getitem__)
    assert packed_linear.available_memory_bytes() == 10 * 4096
    without = "MemTotal:    4096 kB\nMemFree:     512 kB\n"  # a kernel before 3.14 has no MemAvailable line
    monkeypatch.setattr(packed_linear, "open", lambda path: io.StringIO(without), raising=False)
    assert packed_linear.available_memory_bytes() == 10 * 4096  # the free pages, as where it cannot be read

    def unknown(name):
        raise ValueError(f"unrecognized configuration name {name}")  # as os.sysconf says where it has none

    monkeypatch.setattr(packed_linear.os, "sysconf", unknown)
    assert packed_linear.available_memory_bytes() is None  # neither source: it cannot say


def test_apply_packing_refuses_on_where_it_cannot_pack():
    half = frozen(nn.Linear(8, 8)).to(torch.bfloat16)
    pack, line = apply_packing("auto", half)
    assert not pack and "fp32" in line
    with pytest.raises(DDTreeError, match="--packed-weights on: .*fp32.*--packed-weights off"):
        apply_packing("on", half)
    with pytest.raises(DDTreeError, match="choose one of auto, on, off"):
        apply_packing("yes", half)


def test_a_torch_without_onednn_packing_packs_nothing_and_says_so(monkeypatch):
    """auto leaves such a build's layers plain and says why; on refuses in one line naming what works."""
    monkeypatch.setattr(packed_linear, "packing_available", lambda: False)
    model = two_layers()
    assert apply_packing("auto", model) == (False, "[packed weights] off: this torch has no oneDNN weight packing")
    with pytest.raises(DDTreeError) as error:
        apply_packing("on", model)
    assert str(error.value) == ("--packed-weights on: this torch has no oneDNN weight packing; use --packed-weights "
                                "off (or auto)")
    assert not is_packed(model)


@needs_packing
def test_a_subclass_of_linear_keeps_its_own_forward():
    """Only a plain nn.Linear is packed: a subclass with its own forward (a scaled or adapted layer) given the packed
    one would compute a plain linear instead of its own, and a packed target's logits would differ from the plain
    one's."""

    class Doubled(nn.Linear):
        def forward(self, x):
            return 2 * super().forward(x)

    torch.manual_seed(0)
    layer, x = frozen(Doubled(8, 8)), torch.randn(3, 8)
    expected = layer(x)
    assert pack_linears(layer) == 0 and not is_packed(layer)
    torch.testing.assert_close(layer(x), expected)


@needs_packing
def test_on_packs_even_where_the_packed_layers_would_measure_slower(monkeypatch):
    """on insists: it packs without measuring, where auto would have measured packed slower and unpacked."""
    monkeypatch.setattr(packed_linear, "measure_packing", lambda probe: (5.0, 10.0))
    model = two_layers()
    pack, line = apply_packing("on", model)
    assert pack and is_packed(model) and line.startswith("[packed weights] on: linear layers through oneDNN")


@needs_packing
def test_a_layer_is_packed_once_not_again_at_every_forward():
    """The packed copy is made when packing and kept while the weight is unchanged: repacking at each call (a weight
    always taken for changed) cost the reorder of every layer's weight at every decoding step."""
    model = two_layers()
    pack_linears(model)
    packed = [model[0]._ddtree_packed, model[2]._ddtree_packed]
    model(torch.randn(2, 24))
    model(torch.randn(2, 24))
    assert model[0]._ddtree_packed is packed[0] and model[2]._ddtree_packed is packed[1]


def test_refusing_on_names_the_setting_as_its_caller_gives_it():
    """Training's evaluation packs with eval.packed_weights: its refusal told the user to change a flag they never
    gave."""
    half = frozen(nn.Linear(8, 8)).to(torch.bfloat16)
    with pytest.raises(DDTreeError, match=r"^eval\.packed_weights on: .*; use eval\.packed_weights off \(or auto\)$"):
        apply_packing("on", half, "eval.packed_weights")


def test_on_for_a_bf16_model_on_a_cpu_names_the_fp32_that_packs():
    """`--packed-weights on` with the default `--dtype auto`, which picks bf16 where the CPU computes it fast: the line
    told the user to give packing up, not that fp32 (as each caller spells it) packs. On a GPU fp32 does not pack."""
    with pytest.raises(DDTreeError) as error:
        check_packing_choice("on", torch.bfloat16, "cpu")
    assert str(error.value) == ("--packed-weights on: packing is for fp32 on a CPU, and the target would run in "
                                "bfloat16 on cpu; give --dtype float32 to pack, or use --packed-weights off (or auto)")
    with pytest.raises(DDTreeError, match=r"; give dtype='float32' to pack, or use packed_weights off \(or auto\)$"):
        check_packing_choice("on", torch.float16, "cpu", "packed_weights", "dtype='float32'")
    with pytest.raises(DDTreeError) as error:
        check_packing_choice("on", torch.float32, "cuda")
    assert "to pack" not in str(error.value) and str(error.value).endswith("use --packed-weights off (or auto)")
    check_packing_choice("on", torch.float32, "cpu")  # fp32 on a CPU packs: nothing to say
