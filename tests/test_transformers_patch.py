"""liger_portable.transformers: patching Hugging Face models (instance and class level), the
causal-LM forward with the fused loss, the Trainer, torch.compile and the optional dependency.

Every numerical check compares a patched tiny model (tests/hf_tiny.py) with the same model
unpatched, in float32, on the CPU (the PyTorch fallback path). Both compute the same functions in
float32 in a different order, so losses, logits and gradients agree to ~1e-7 relative (measured
<= 6e-7); the bound is 1e-5 (TOL). Training runs (optimizer, Trainer, compile) take 2-3 steps,
where the same holds.

Runtime: about 20 s of test time (``-n 2``: about 15 s wall), half of it the two torch.compile cases
and the subprocess import check.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import os
import subprocess
import sys
import types

import pytest
import torch

transformers = pytest.importorskip("transformers")

from hf_tiny import FAMILIES, VOCAB, isolated_patching, tiny_config, tiny_model  # noqa: E402,F401

import liger_portable.functional as LF  # noqa: E402
import liger_portable.transformers as lpt  # noqa: E402
from liger_portable.transformers import _forward, _patch  # noqa: E402

from conftest import rel_err  # noqa: E402

TOL = 1e-5

# The causal LM's cache argument (and output field): ``cache`` in transformers after 5.17,
# ``past_key_values`` before (later releases still take the old name, deprecated).
CACHE_ARG = "cache" if "cache" in inspect.signature(transformers.LlamaForCausalLM.forward).parameters else "past_key_values"

# Liger-Kernel's class-level functions: name -> (family in hf_tiny, parameters with defaults).
_LIGER = dict(rope=True, cross_entropy=False, fused_linear_cross_entropy=True, rms_norm=True)
LIGER_FUNCTIONS = {
    "apply_liger_kernel_to_llama": ("llama", {**_LIGER, "swiglu": True, "model": None}),
    "apply_liger_kernel_to_mistral": ("mistral", {**_LIGER, "swiglu": True, "model": None}),
    "apply_liger_kernel_to_mixtral": ("mixtral", {**_LIGER, "swiglu": True, "model": None}),
    "apply_liger_kernel_to_qwen2": ("qwen2", {**_LIGER, "swiglu": True, "model": None}),
    "apply_liger_kernel_to_qwen3": ("qwen3", {**_LIGER, "swiglu": True, "model": None}),
    "apply_liger_kernel_to_gemma": ("gemma", {**_LIGER, "geglu": True, "model": None}),
    "apply_liger_kernel_to_gemma2": ("gemma2", {**_LIGER, "geglu": True, "model": None}),
    "apply_liger_kernel_to_gemma3_text": ("gemma3", {**_LIGER, "geglu": True, "model": None}),
    "apply_liger_kernel_to_phi3": ("phi3", {**_LIGER, "swiglu": True, "model": None}),
    # Liger-Kernel's Granite defaults: cross_entropy on, fused linear cross-entropy off.
    "apply_liger_kernel_to_granite": (
        "granite",
        dict(rope=True, cross_entropy=True, fused_linear_cross_entropy=False, rms_norm=True, swiglu=True, model=None),
    ),
}


pytestmark = pytest.mark.usefixtures("isolated_patching")


@pytest.fixture
def calls(monkeypatch):
    """Counts the calls of liger_portable.functional's ops (the patched modules call them there)."""
    counts = {}
    for name in ("rms_norm", "rope", "swiglu", "geglu", "cross_entropy", "fused_linear_cross_entropy"):
        fn = getattr(LF, name)

        def wrapper(*args, _fn=fn, _name=name, **kwargs):
            counts[_name] = counts.get(_name, 0) + 1
            counts.setdefault("_kwargs", {})[_name] = kwargs
            return _fn(*args, **kwargs)

        monkeypatch.setattr(LF, name, wrapper)
    return counts


@contextlib.contextmanager
def unpatched():
    """Hugging Face's own module-level code for the duration (``patch`` replaces the modeling
    modules' ``apply_rotary_pos_emb`` for every model of the family, the reference included)."""
    saved = _patch.originals()
    current = {key: getattr(*key) for key in saved}
    for (owner, attr), value in saved.items():
        setattr(owner, attr, value)
    try:
        yield
    finally:
        for (owner, attr), value in current.items():
            setattr(owner, attr, value)


def ref_call(model, **kwargs):
    """``model(**kwargs)`` with Hugging Face's module-level code (see :func:`unpatched`)."""
    with unpatched():
        return model(**kwargs)


def batch(seed: int = 0, batch_size: int = 2, seq: int = 19):
    """input_ids, attention_mask (last 4 tokens of row 1 padded) and labels (-100 on the padding
    and on the first 3 tokens of row 0)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (batch_size, seq), generator=g)
    mask = torch.ones_like(ids)
    mask[1, -4:] = 0
    ids[1, -4:] = 0
    labels = ids.masked_fill(mask == 0, -100)
    labels[0, :3] = -100
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def assert_grads_match(model, ref, tol=TOL):
    ref_params = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        r = ref_params[name]
        if r.grad is None:
            assert p.grad is None, name
            continue
        # Qwen-2's key bias has a zero gradient in exact arithmetic (softmax shift invariance):
        # compare it in absolute terms.
        if name.endswith("k_proj.bias"):
            assert (p.grad - r.grad).abs().max() <= 1e-6, name
            continue
        assert rel_err(p.grad, r.grad) <= tol, f"{name}: gradient error {rel_err(p.grad, r.grad):.2e}"


# --------------------------------------------------------------------------- optional dependency


def test_import_without_transformers():
    """``import liger_portable`` must not need transformers; ``liger_portable.transformers`` says
    how to install it."""
    code = r"""
import sys

class Block:
    def find_spec(self, name, path=None, target=None):
        if name == "transformers" or name.startswith("transformers."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None

sys.meta_path.insert(0, Block())
import torch
import liger_portable
from liger_portable import functional as F, nn
F.rms_norm(torch.randn(3, 8), torch.ones(8))
assert "transformers" not in sys.modules
try:
    import liger_portable.transformers
except ImportError as e:
    print("ERROR:", e)
else:
    raise SystemExit("liger_portable.transformers imported without transformers")
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=dict(os.environ))
    assert out.returncode == 0, out.stderr
    assert 'pip install "transformers>=5.0,<5.25" (or pip install ".[hf]"' in out.stdout, out.stdout


# --------------------------------------------------------------------------- patch(model), every family


@pytest.mark.parametrize("family", FAMILIES)
def test_patch_matches_hugging_face(family, calls):
    ref = tiny_model(family, seed=3)
    model = tiny_model(family, seed=3)
    params_before = {name: p for name, p in model.named_parameters()}
    keys_before = list(model.state_dict())

    assert lpt.patch(model) is model

    # Same Parameter objects and the same state_dict.
    assert {name: p for name, p in model.named_parameters()} == params_before
    assert all(p is params_before[name] for name, p in model.named_parameters())
    assert list(model.state_dict()) == keys_before
    # No Hugging Face norm or MLP is left.
    fam = _patch.FAMILIES[family]
    hf_classes = {getattr(fam.modeling, fam.norm)} | ({getattr(fam.modeling, fam.mlp)} if fam.mlp else set())
    left = [name for name, m in model.named_modules() if type(m) in hf_classes]
    assert not left, f"not replaced: {left}"

    data = batch()
    out = model(**data)
    ref_out = ref_call(ref, **data)
    assert out.logits is None, "training with labels must not build the logits"
    assert abs(out.loss.item() - ref_out.loss.item()) <= TOL * abs(ref_out.loss.item())
    assert out.loss.dtype == torch.float32
    out.loss.backward()
    ref_out.loss.backward()
    assert_grads_match(model, ref)

    # Every fused op ran (Mixtral's experts use _apply_gate: swiglu too).
    glu = "geglu" if fam.glu == "geglu" else "swiglu"
    for op in ("rms_norm", "rope", glu, "fused_linear_cross_entropy"):
        assert calls.get(op, 0) > 0, f"{op} was not called; calls: {calls}"

    # Without labels: the logits, as Hugging Face's.
    with torch.no_grad():
        logits = model(input_ids=data["input_ids"], attention_mask=data["attention_mask"]).logits
        ref_logits = ref_call(ref, input_ids=data["input_ids"], attention_mask=data["attention_mask"]).logits
    assert rel_err(logits, ref_logits) <= TOL


@pytest.mark.parametrize("family", ["llama", "gemma", "qwen3"])
def test_norms_keep_the_models_epsilon(family):
    """The swapped norms keep the epsilon of the model's (``config.rms_norm_eps``, here 1e-2 rather
    than hf_tiny's 1e-6, which is also liger_portable's default): Llama's ``variance_epsilon``,
    Gemma's ``eps``, Qwen-3's q/k norms too."""
    config = tiny_config(family)
    config.rms_norm_eps = 1e-2
    config._attn_implementation = "eager"

    def build():
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(23)
            return transformers.AutoModelForCausalLM.from_config(config).train()

    ref, model = build(), lpt.patch(build())
    data = batch(10)
    out, ref_out = model(**data), ref_call(ref, **data)
    assert abs(out.loss.item() - ref_out.loss.item()) <= TOL * ref_out.loss.item()
    out.loss.backward()
    ref_out.loss.backward()
    assert_grads_match(model, ref)


def test_patch_base_model_and_idempotence(calls):
    """A base model (no LM head) gets its norms, MLPs and RoPE patched; patching twice is harmless."""
    ref = tiny_model("llama", seed=1).model
    base = tiny_model("llama", seed=1).model
    forward = base.forward
    lpt.patch(base)
    lpt.patch(base)
    assert base.forward == forward
    ids = batch()["input_ids"]
    h, h_ref = base(input_ids=ids).last_hidden_state, ref_call(ref, input_ids=ids).last_hidden_state
    assert rel_err(h, h_ref) <= TOL
    assert calls["rms_norm"] == 5 and calls["swiglu"] == 2 and calls["rope"] == 2


def test_wrapped_projection_moves_over():
    """The MLP swap takes the projections as they are, so a wrapper (e.g. a LoRA layer) stays."""

    class Wrapped(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, x):
            return self.inner(x) * 0.5

    ref = tiny_model("llama", seed=14)
    model = tiny_model("llama", seed=14)
    for m in (ref, model):
        m.model.layers[0].mlp.up_proj = Wrapped(m.model.layers[0].mlp.up_proj)
    wrapper = model.model.layers[0].mlp.up_proj
    lpt.patch(model)
    assert type(model.model.layers[0].mlp) is lpt.SwiGLUMLP and model.model.layers[0].mlp.up_proj is wrapper
    data = batch()
    assert abs(model(**data).loss.item() - ref_call(ref, **data).loss.item()) <= TOL * 10


class LoraHead(torch.nn.Module):
    """A stand-in for PEFT's LoRA layer on the LM head: ``weight`` and ``bias`` are the base
    layer's (as PEFT exposes them), the output adds a low-rank term."""

    def __init__(self, base: torch.nn.Linear, rank: int = 4):
        super().__init__()
        self.base_layer = base
        g = torch.Generator().manual_seed(7)
        self.lora_a = torch.nn.Parameter(torch.randn(rank, base.in_features, generator=g) * 0.1)
        self.lora_b = torch.nn.Parameter(torch.randn(base.out_features, rank, generator=g) * 0.1)

    weight = property(lambda self: self.base_layer.weight)
    bias = property(lambda self: self.base_layer.bias)

    def forward(self, x):
        return self.base_layer(x) + (x @ self.lora_a.T) @ self.lora_b.T


class ScaledHead(torch.nn.Linear):
    """An ``nn.Linear`` subclass with a forward of its own (the output scaled by 1.5)."""

    def forward(self, x):
        return super().forward(x) * 1.5


@pytest.mark.parametrize(
    "head",
    ["lora, before patch", "lora, after patch", "forward hook", "forward pre-hook", "global forward hook",
     "linear subclass"],
)
def test_wrapped_or_hooked_lm_head_keeps_its_output(head, calls):
    """The fused loss reads the LM head's weight, so it would leave out what a wrapper (LoRA), a
    subclass's own forward or a hook (on the head, or a global module hook) adds: such a head is
    called as it is and the loss is the cross-entropy of its logits, equal to Hugging Face's, with
    the adapter's gradients."""
    ref = tiny_model("llama", seed=15)
    model = tiny_model("llama", seed=15)
    heads = []

    def wrap(m):
        if head.startswith("lora"):
            m.lm_head = LoraHead(m.lm_head)
        elif head == "forward hook":
            m.lm_head.register_forward_hook(lambda mod, args, out: out * 1.5)
        elif head == "forward pre-hook":
            m.lm_head.register_forward_pre_hook(lambda mod, args: (args[0] * 1.5,))
        elif head == "global forward hook":
            heads.append(m.lm_head)
        else:
            sub = ScaledHead(m.lm_head.in_features, m.lm_head.out_features, bias=False, device="meta")
            sub.weight = m.lm_head.weight
            m.lm_head = sub

    wrap(ref)
    if head != "lora, after patch":
        wrap(model)
    lpt.patch(model)
    if head == "lora, after patch":
        wrap(model)
    data = batch(2)
    with contextlib.ExitStack() as stack:
        if head == "global forward hook":  # every module's hook: it scales the outputs of the two LM heads
            handle = torch.nn.modules.module.register_module_forward_hook(
                lambda mod, args, out: out * 1.5 if any(mod is h for h in heads) else None
            )
            stack.callback(handle.remove)
        out, ref_out = model(**data), ref_call(ref, **data)
    assert calls.get("fused_linear_cross_entropy", 0) == 0 and calls.get("cross_entropy", 0) == 1
    assert abs(out.loss.item() - ref_out.loss.item()) <= TOL * ref_out.loss.item()
    out.loss.backward()
    ref_out.loss.backward()
    assert_grads_match(model, ref)
    if head.startswith("lora"):
        assert model.lm_head.lora_a.grad is not None and model.lm_head.lora_a.grad.abs().sum() > 0


def test_patch_inside_a_wrapper_that_proxies_the_config(calls):
    """A wrapper holding the causal LM and proxying its config (as PEFT's PeftModel does) is
    patched through: the norms and MLPs, and the loss of the causal LM inside (no logits)."""

    class Wrapper(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.base_model = inner

        config = property(lambda self: self.base_model.config)

        def forward(self, **kwargs):
            return self.base_model(**kwargs)

    ref = tiny_model("llama", seed=16)
    inner = tiny_model("llama", seed=16)
    wrapper = Wrapper(inner)
    assert lpt.patch(wrapper, chunk_mib=64) is wrapper
    assert "forward" in vars(inner) and getattr(inner, "liger_portable_chunk_mib") == 64
    data = batch(3)
    out, ref_out = wrapper(**data), ref_call(ref, **data)
    assert out.logits is None and calls.get("fused_linear_cross_entropy", 0) == 1
    assert abs(out.loss.item() - ref_out.loss.item()) <= TOL * ref_out.loss.item()


def test_subclass_of_the_causal_lm_gets_the_fused_loss(calls):
    """A subclass of transformers' LlamaForCausalLM (a class of the user's that keeps its forward)
    is a causal LM of the family: patch() gives it the fused loss (no logits), with Hugging Face's
    loss and gradients, and no warning."""
    import warnings

    class MyCausalLM(transformers.LlamaForCausalLM):
        pass

    ref = tiny_model("llama", seed=25)
    model = MyCausalLM(ref.config)
    model.load_state_dict(ref.state_dict())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        lpt.patch(model.train())
    data = batch(12)
    out, ref_out = model(**data), ref_call(ref, **data)
    assert out.logits is None and calls.get("fused_linear_cross_entropy", 0) == 1
    assert abs(out.loss.item() - ref_out.loss.item()) <= TOL * ref_out.loss.item()
    out.loss.backward()
    ref_out.loss.backward()
    assert_grads_match(model, ref)


def test_classes_of_another_module_are_an_error(tmp_path):
    """A model whose config names a supported type but whose classes come from another module
    (remote code, trust_remote_code=True) has none of the classes patching replaces: an error,
    not a model that silently runs unpatched. Stood in for by Hugging Face's llama source loaded
    as a module of its own."""
    import importlib.util

    from transformers.models.llama import modeling_llama

    spec = importlib.util.spec_from_file_location("transformers.models.llama.remote_llama_copy", modeling_llama.__file__)
    remote = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = remote
    try:
        spec.loader.exec_module(remote)
        model = remote.LlamaForCausalLM(tiny_config("llama"))
        with pytest.raises(ValueError, match="found none of Hugging Face's llama modules .*remote code"):
            lpt.patch(model)
        assert "forward" not in vars(model)
        assert not any(type(m).__module__.startswith("liger_portable") for m in model.modules())
    finally:
        del sys.modules[spec.name]


def test_own_causal_lm_class_around_transformers_modules_warns_that_its_loss_is_not_fused():
    """A causal LM of its own class around transformers' LlamaModel (remote code reusing it): the
    norms and MLPs are patched and a warning says the loss is not fused (by patch() and by
    apply_liger_kernel_to_llama(model=...)); transformers' base model and other heads, whose loss
    there is none to fuse, patch without one."""
    import warnings

    from transformers import LlamaForSequenceClassification, LlamaModel

    class OwnCausalLM(torch.nn.Module):
        def __init__(self, config):
            super().__init__()
            self.config = config
            self.model = LlamaModel(config)
            self.lm_head = torch.nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    model = OwnCausalLM(tiny_config("llama"))
    with pytest.warns(UserWarning, match="OwnCausalLM is not transformers' LlamaForCausalLM .* loss is not fused"):
        lpt.patch(model)
    assert type(model.model.norm).__module__ == "liger_portable.nn"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        lpt.patch(OwnCausalLM(tiny_config("llama")), fused_linear_cross_entropy=False)
        lpt.patch(LlamaModel(tiny_config("llama")))
        config = tiny_config("llama")
        config.pad_token_id = 0
        lpt.patch(LlamaForSequenceClassification(config))
    # The class-level entry point with model= says the same of such a model.
    with pytest.warns(UserWarning, match="OwnCausalLM is not transformers' LlamaForCausalLM .* loss is not fused"):
        lpt.apply_liger_kernel_to_llama(model=OwnCausalLM(tiny_config("llama")))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        lpt.apply_liger_kernel_to_llama(model=OwnCausalLM(tiny_config("llama")), fused_linear_cross_entropy=False)


def test_mixtral_experts_of_another_activation_keep_their_product(calls):
    """After apply_liger_kernel_to_mixtral(), a Mixtral built with another activation computes its
    own product (the class-level gate cannot check the config when it is replaced)."""
    config = tiny_config("mixtral")
    config.hidden_act = "gelu"
    ref = type(tiny_model("mixtral"))(config)
    lpt.apply_liger_kernel_to_mixtral(rope=False, rms_norm=False, fused_linear_cross_entropy=False)
    torch.manual_seed(0)
    model = type(ref)(config)
    model.load_state_dict(ref.state_dict())
    data = batch(4)
    out, ref_out = model(**data), ref_call(ref, **data)
    assert calls.get("swiglu", 0) == 0
    assert abs(out.loss.item() - ref_out.loss.item()) <= TOL * ref_out.loss.item()


def test_phi3_mlp_of_another_activation_is_refused():
    """After apply_liger_kernel_to_phi3(), building a Phi-3 whose activation is not SiLU raises
    (the fused gate/up MLP computes silu; the class-level patch cannot check the config earlier)
    rather than compute another model than Hugging Face's."""
    config = tiny_config("phi3")
    config.hidden_act = "gelu"
    cls = type(tiny_model("phi3"))
    lpt.apply_liger_kernel_to_phi3()
    with pytest.raises(ValueError, match="config.hidden_act is 'gelu' but Phi3SwiGLUMLP computes 'silu'"):
        cls(config)


@pytest.mark.parametrize("family", ["llama", "phi3", "gemma"])
def test_patch_meta_device_model(family):
    """A model built on the meta device (how large models are built before their weights load) is
    patched: meta parameters are parameters. Its MLPs and norms are swapped, holding the same
    Parameter objects, and still on meta; an MLP that lacks a projection is still refused."""
    import transformers as tf

    config = tiny_config(family)
    with torch.device("meta"):
        model = tf.AutoModelForCausalLM.from_config(config)
    mlp = model.model.layers[0].mlp
    projections = {n: c for n, c in mlp.named_children() if n.endswith("proj")}
    lpt.patch(model)
    new = model.model.layers[0].mlp
    assert type(new).__module__.startswith("liger_portable") and type(model.model.norm).__module__.startswith("liger_portable")
    assert all(getattr(new, n) is c for n, c in projections.items())
    assert all(p.is_meta for p in model.parameters())
    broken = tiny_model("llama")
    del broken.model.layers[0].mlp.up_proj
    with pytest.raises(ValueError, match=r"lacks up_proj"):
        lpt.patch(broken)


@pytest.mark.parametrize("family", ["phi3", "gemma"])
def test_gradient_checkpointing(family):
    """Under Hugging Face's gradient checkpointing the layers run twice; the fused MLP's in-place
    backward writes into the recomputed activations."""
    ref = tiny_model(family, seed=15)
    model = lpt.patch(tiny_model(family, seed=15))
    for m in (ref, model):
        if hasattr(m, "activation_checkpointing_enable"):  # transformers >= 5.2x
            m.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    data = batch()
    out, ref_out = model(**data), ref_call(ref, **data)
    assert abs(out.loss.item() - ref_out.loss.item()) <= TOL * ref_out.loss.item()
    out.loss.backward()
    ref_out.loss.backward()
    assert_grads_match(model, ref)


# --------------------------------------------------------------------------- the causal-LM forward


@pytest.mark.parametrize("family", ["llama", "gemma2", "granite"])
def test_eval_mode_with_labels(family):
    """Eval mode with labels: the logits are built (as Hugging Face does) and the loss is the fused
    cross-entropy of them (with the family's softcap / logit scaling already applied)."""
    ref = tiny_model(family, seed=2).eval()
    model = lpt.patch(tiny_model(family, seed=2)).eval()
    data = batch(1)
    with torch.no_grad():
        out, ref_out = model(**data), ref_call(ref, **data)
    assert out.logits is not None
    assert rel_err(out.logits, ref_out.logits) <= TOL
    assert abs(out.loss.item() - ref_out.loss.item()) <= TOL * ref_out.loss.item()


@pytest.mark.parametrize("softcap", [1.5, None])
def test_final_logit_softcapping_of_the_config(softcap):
    """Gemma-2's ``final_logit_softcapping`` is the config's value (another one than hf_tiny's 3.0,
    or None: no softcap), in the fused loss (training) and on the built logits (eval)."""
    ref = tiny_model("gemma2", seed=21)
    model = lpt.patch(tiny_model("gemma2", seed=21))
    for m in (ref, model):
        m.config.final_logit_softcapping = softcap
    data = batch(8)
    out, ref_out = model(**data), ref_call(ref, **data)
    assert out.logits is None
    assert abs(out.loss.item() - ref_out.loss.item()) <= TOL * ref_out.loss.item()
    out.loss.backward()
    ref_out.loss.backward()
    assert_grads_match(model, ref)
    with torch.no_grad():
        logits = model.eval()(**data).logits
        ref_logits = ref_call(ref.eval(), **data).logits
    assert rel_err(logits, ref_logits) <= TOL


@pytest.mark.parametrize("family", ["llama", "granite"])
def test_bf16_loss_of_built_logits_is_float32_as_hugging_faces(family):
    """Where the loss comes from built logits (eval mode; Granite's default cross_entropy=True) of a
    bf16 model, it is Hugging Face's float32 loss of the upcast logits, not one rounded to bf16
    (which put an eval loss 0.2% and its perplexity 1.3% off)."""
    ref = tiny_model(family, torch.bfloat16, seed=2).eval()
    model = lpt.patch(tiny_model(family, torch.bfloat16, seed=2), fused_linear_cross_entropy=False,
                      cross_entropy=True, rope=False, rms_norm=False, swiglu=False)  # the loss alone: the same logits
    data = batch(1)
    with torch.no_grad():
        out, ref_out = model(**data), ref_call(ref, **data)
        model.eval()
        out_eval = model(**data)
    assert torch.equal(out.logits, ref_out.logits)
    for o in (out, out_eval):
        assert o.loss.dtype == torch.float32 and rel_err(o.loss, ref_out.loss) <= 1e-6, rel_err(o.loss, ref_out.loss)


@pytest.mark.parametrize("mode", ["fused_linear_cross_entropy", "cross_entropy"])
def test_float64_model_loss_is_float32_as_hugging_faces(mode):
    """Hugging Face's loss is float32 whatever the model's dtype (its loss takes ``logits.float()``),
    also for a float64 model: so is the patched one's, in both loss modes, with the same value."""
    ref = tiny_model("llama", torch.float64, seed=22)
    model = lpt.patch(tiny_model("llama", torch.float64, seed=22),
                      fused_linear_cross_entropy=mode == "fused_linear_cross_entropy", cross_entropy=mode == "cross_entropy")
    data = batch(9)
    for kwargs in ({}, {"num_items_in_batch": 20}):
        out, ref_out = model(**data, **kwargs), ref_call(ref, **data, **kwargs)
        assert ref_out.loss.dtype == torch.float32 and out.loss.dtype == ref_out.loss.dtype, kwargs
        assert abs(out.loss.item() - ref_out.loss.item()) <= TOL * ref_out.loss.item(), kwargs


@pytest.mark.parametrize("family", ["gemma", "gemma2", "gemma3"])
def test_gemma_norms_in_bf16_round_once_as_hugging_faces(family):
    """A bf16 Gemma-family model's norms compute ``x / rms(x) * (1 + weight)`` in float32 and round
    once, as Hugging Face's GemmaRMSNorm (Llama's casting rounds the normalised x to bf16 before the
    product). The norms alone are patched (the rest is Hugging Face's code), with weights away from
    their zero initialisation (``1 + 0`` multiplies exactly either way): the logits agree to
    float32 round-off (measured: bitwise equal; Llama's casting puts them 9e-3 to 2e-2 apart)."""
    ref = tiny_model(family, torch.bfloat16, seed=24).eval()
    model = tiny_model(family, torch.bfloat16, seed=24).eval()
    with torch.no_grad():
        for m in (ref, model):
            g = torch.Generator().manual_seed(24)
            for name, p in sorted(m.named_parameters()):
                if name.endswith("norm.weight"):
                    p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    lpt.patch(model, rope=False, swiglu=False, fused_linear_cross_entropy=False)
    data = batch(11)
    with torch.no_grad():
        logits = model(input_ids=data["input_ids"], attention_mask=data["attention_mask"]).logits
        ref_logits = ref_call(ref, input_ids=data["input_ids"], attention_mask=data["attention_mask"]).logits
    assert rel_err(logits, ref_logits) <= 1e-3


@pytest.mark.parametrize("mode", ["fused_linear_cross_entropy", "cross_entropy"])
@pytest.mark.parametrize("family", ["llama", "gemma2", "granite"])
def test_loss_options_match_hugging_face(family, mode, calls):
    """``num_items_in_batch`` (the Trainer's gradient accumulation: sum / count), ``shift_labels``
    (also flattened) and ``ignore_index`` as Hugging Face's loss takes them, in both loss modes."""
    ref = tiny_model(family, seed=4)
    model = lpt.patch(
        tiny_model(family, seed=4),
        fused_linear_cross_entropy=mode == "fused_linear_cross_entropy", cross_entropy=mode == "cross_entropy",
    )
    data = batch(2)
    labels = data["labels"]
    shifted = torch.nn.functional.pad(labels[:, 1:], (0, 1), value=-100)
    shifted_custom = shifted.masked_fill(shifted == 7, -1)  # also exercise ignore_index=-1
    cases = [
        dict(num_items_in_batch=torch.tensor(11)),
        dict(num_items_in_batch=5),
        dict(shift_labels=shifted),
        dict(shift_labels=shifted.flatten()),  # flattened: Hugging Face's loss takes them so too
        dict(shift_labels=shifted_custom.masked_fill(shifted_custom == -100, -1), ignore_index=-1),
    ]
    for kwargs in cases:
        model.zero_grad()
        ref.zero_grad()
        out = model(**data, **kwargs)
        ref_out = ref_call(ref, **data, **kwargs)
        assert (out.logits is None) == (mode == "fused_linear_cross_entropy")
        assert abs(out.loss.item() - ref_out.loss.item()) <= TOL * abs(ref_out.loss.item()), kwargs
        out.loss.backward()
        ref_out.loss.backward()
        assert_grads_match(model, ref)
    expected = "fused_linear_cross_entropy" if mode == "fused_linear_cross_entropy" else "cross_entropy"
    assert calls[expected] == len(cases)
    assert calls["_kwargs"][expected]["ignore_index"] == -1


@pytest.mark.parametrize("mode", ["fused_linear_cross_entropy", "cross_entropy"])
def test_ignore_index_of_unshifted_labels(mode):
    """``ignore_index`` with ``labels`` (not ``shift_labels``): the shift pads the last position
    with ``ignore_index``, as Hugging Face's ``ForCausalLMLoss`` does, so that position is ignored
    (padded with -100 instead, it would be a target outside the vocabulary)."""
    ref = tiny_model("llama", seed=4)
    model = lpt.patch(tiny_model("llama", seed=4), fused_linear_cross_entropy=mode == "fused_linear_cross_entropy",
                      cross_entropy=mode == "cross_entropy")
    data = batch(3)
    data["labels"] = data["labels"].masked_fill(data["labels"] == -100, -1)
    out, ref_out = model(**data, ignore_index=-1), ref_call(ref, **data, ignore_index=-1)
    assert abs(out.loss.item() - ref_out.loss.item()) <= TOL * ref_out.loss.item()
    out.loss.backward()
    ref_out.loss.backward()
    assert_grads_match(model, ref)


def test_chunk_mib(monkeypatch, calls):
    """``patch(model, chunk_mib=N)`` reaches the fused loss (kept as a model attribute that may be
    changed later); the results stay Hugging Face's. The fallback's MiB is lowered to 4 KiB, so
    N=1 is 8 rows of fp32 logits over the tiny vocabulary."""
    fb = importlib.import_module("liger_portable.fallback.cross_entropy")
    rows = []
    real = fb.ce_rows_torch
    monkeypatch.setattr(fb, "ce_rows_torch", lambda x, *a: rows.append(x.shape[0]) or real(x, *a))
    monkeypatch.setattr(fb, "CHUNK_UNIT", 4096)
    per_chunk = fb.chunk_rows(VOCAB, 4, 4096)
    ref = tiny_model("llama", seed=5)
    model = lpt.patch(tiny_model("llama", seed=5), chunk_mib=1)
    assert model.liger_portable_chunk_mib == 1 and 1 <= per_chunk < 38
    data = batch(3)
    out = model(**data)
    ref_out = ref_call(ref, **data)
    assert abs(out.loss.item() - ref_out.loss.item()) <= TOL * abs(ref_out.loss.item())
    out.loss.backward()
    ref_out.loss.backward()
    assert_grads_match(model, ref)
    assert calls["_kwargs"]["fused_linear_cross_entropy"]["chunk_mib"] == 1
    assert rows == [per_chunk] * (38 // per_chunk) + ([38 % per_chunk] if 38 % per_chunk else [])
    rows.clear()
    model.liger_portable_chunk_mib = None  # back to the default chunk: one chunk of 38 tokens here
    model(**data)
    assert rows == [38] and calls["_kwargs"]["fused_linear_cross_entropy"]["chunk_mib"] is None


def test_chunk_mib_errors_change_nothing():
    model = tiny_model("llama")
    for kwargs, match in (
        (dict(chunk_mib=0), "chunk_mib must be None"),
        (dict(chunk_mib=64, fused_linear_cross_entropy=False), "needs fused_linear_cross_entropy=True"),
    ):
        with pytest.raises(ValueError, match=match):
            lpt.patch(model, **kwargs)
        assert "forward" not in vars(model) and not hasattr(model, "liger_portable_chunk_mib")
        assert any(type(m).__name__ == "LlamaRMSNorm" for m in model.modules())


def test_logits_to_keep_and_return_dict():
    ref = tiny_model("llama", seed=5)
    model = lpt.patch(tiny_model("llama", seed=5))
    ids = batch()["input_ids"]
    with torch.no_grad():
        out = model(input_ids=ids, logits_to_keep=3)
        ref_out = ref_call(ref, input_ids=ids, logits_to_keep=3)
        tup = model(input_ids=ids, return_dict=False)
    assert out.logits.shape == (2, 3, VOCAB)
    assert rel_err(out.logits, ref_out.logits) <= TOL
    assert isinstance(tup, tuple) and tup[0].shape == (2, ids.shape[1], VOCAB)


def test_logits_to_keep_tensors():
    """``logits_to_keep`` as a tensor, in the forms Hugging Face's ``slice_logits_to_keep`` takes:
    1-D positions (the same for every row), 2-D integer positions per row, a 2-D boolean mask
    (flattened output); the patched model keeps the same positions as the installed Hugging Face
    release (before ``slice_logits_to_keep``, a 2-D tensor indexes the positions as a 1-D one)."""
    ref = tiny_model("llama", seed=5)
    model = lpt.patch(tiny_model("llama", seed=5))
    ids = batch()["input_ids"]
    g = torch.Generator().manual_seed(5)
    mask = torch.rand(ids.shape, generator=g) < 0.4
    cases = {
        "1-D positions": torch.tensor([0, 4, 5, 11]),
        "2-D positions": torch.stack([torch.randperm(ids.shape[1], generator=g)[:5] for _ in range(ids.shape[0])]),
        "2-D mask": mask,
    }
    for name, keep in cases.items():
        with torch.no_grad():
            try:
                ref_out = ref_call(ref, input_ids=ids, logits_to_keep=keep)
            except IndexError:  # a 2-D mask before slice_logits_to_keep (transformers 5.17 and earlier)
                assert not _forward.PER_ROW_KEEP, name
                with pytest.raises(IndexError):
                    model(input_ids=ids, logits_to_keep=keep)
                continue
            out = model(input_ids=ids, logits_to_keep=keep)
        assert out.logits.shape == ref_out.logits.shape, name
        assert rel_err(out.logits, ref_out.logits) <= TOL, name


@pytest.mark.parametrize("case", ["position_ids", "inputs_embeds", "output_hidden_states"])
def test_base_model_arguments_and_outputs(case):
    """The patched forward hands the base model what Hugging Face's does and returns what it
    returns: ``position_ids`` (packed sequences: positions restart inside a row, which changes the
    rotary embedding), ``inputs_embeds`` instead of ``input_ids``, and the hidden states and
    attention weights asked for with ``output_hidden_states`` / ``output_attentions``."""
    ref = tiny_model("llama", seed=20)
    model = lpt.patch(tiny_model("llama", seed=20))
    data = batch(7)
    if case == "position_ids":
        seq = data["input_ids"].shape[1]
        data["position_ids"] = torch.cat([torch.arange(8), torch.arange(seq - 8)]).expand(2, seq)
    elif case == "inputs_embeds":
        with torch.no_grad():
            data["inputs_embeds"] = ref.model.embed_tokens(data.pop("input_ids"))
    else:
        data.update(output_hidden_states=True, output_attentions=True)
    out, ref_out = model(**data), ref_call(ref, **data)
    assert abs(out.loss.item() - ref_out.loss.item()) <= TOL * ref_out.loss.item()
    out.loss.backward()
    ref_out.loss.backward()
    assert_grads_match(model, ref)
    if case == "output_hidden_states":
        for name in ("hidden_states", "attentions"):
            got, want = getattr(out, name), getattr(ref_out, name)
            assert want is not None and got is not None and len(got) == len(want), name
            for a, b in zip(got, want):
                assert rel_err(a, b) <= TOL, name


@pytest.mark.parametrize("source", ["argument", "config"])
def test_mixtral_router_aux_loss(source):
    """Mixtral's router auxiliary loss, asked for by the ``output_router_logits`` argument or by the
    config's ``output_router_logits`` (the default when the argument is not given), is added to the
    loss as Hugging Face's."""
    ref = tiny_model("mixtral", seed=6)
    model = lpt.patch(tiny_model("mixtral", seed=6))
    data = batch(3)
    if source == "config":
        for m in (ref, model):
            m.config.output_router_logits = True
    else:
        data["output_router_logits"] = True
    out = model(**data)
    ref_out = ref_call(ref, **data)
    assert out.aux_loss is not None and len(out.router_logits) == 2
    assert abs(out.aux_loss.item() - ref_out.aux_loss.item()) <= TOL * ref_out.aux_loss.item()
    assert abs(out.loss.item() - ref_out.loss.item()) <= TOL * ref_out.loss.item()
    out.loss.backward()
    ref_out.loss.backward()
    assert_grads_match(model, ref)


def test_generate_matches_hugging_face():
    """Generation (no labels, KV cache, logits_to_keep=1) takes the logits path."""
    ref = tiny_model("llama", seed=7).eval()
    model = lpt.patch(tiny_model("llama", seed=7)).eval()
    ids = batch()["input_ids"][:1, :6]
    kwargs = dict(max_new_tokens=5, do_sample=False, use_cache=True, pad_token_id=0)
    out = model.generate(ids, **kwargs)
    with unpatched():
        ref_out = ref.generate(ids, **kwargs)
    assert torch.equal(out, ref_out)


# --------------------------------------------------------------------------- training


def test_optimizer_built_before_patch_and_state_dict():
    """The patch keeps the Parameter objects: an optimizer built before it trains the patched
    model; a Hugging Face state_dict loads into it (strict)."""
    ref = tiny_model("gemma", seed=8)
    model = tiny_model("gemma", seed=8)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    lpt.patch(model)
    for step in range(3):
        data = batch(step)
        model(**data).loss.backward()
        ref_call(ref, **data).loss.backward()
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad()
    ref_params = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        assert rel_err(p, ref_params[name]) <= TOL, name
    fresh = lpt.patch(tiny_model("gemma", seed=9))
    fresh.load_state_dict(ref.state_dict(), strict=True)
    data = batch(4)
    ref_loss = ref_call(ref, **data).loss.item()
    assert abs(fresh(**data).loss.item() - ref_loss) <= TOL * ref_loss


@pytest.mark.parametrize("family", ["llama", "gemma2"])
def test_autocast_bf16(family):
    """fp32 weights under ``torch.autocast(bfloat16)`` (the Trainer's ``bf16=True``): the patched
    model gives Hugging Face's loss and gradients up to bf16 rounding. Both runs compute their
    matmuls in bf16 (8 significant bits) at different places; measured: losses 1e-4, gradients
    (all parameters, norm-wise) 9e-3 apart. Bounds: 1e-2 and 3e-2."""
    ref = tiny_model(family, seed=16)
    model = lpt.patch(tiny_model(family, seed=16))
    data = batch()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, ref_out = model(**data), ref_call(ref, **data)
    assert abs(out.loss.item() - ref_out.loss.item()) <= 1e-2 * ref_out.loss.item()
    out.loss.backward()
    ref_out.loss.backward()
    grads = torch.cat([p.grad.flatten() for p in model.parameters()])
    ref_grads = torch.cat([p.grad.flatten() for p in ref.parameters()])
    assert rel_err(grads, ref_grads) <= 3e-2


@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
def test_float32_head_of_a_bf16_model_under_autocast(bias, calls):
    """A float32 LM head in a bf16 model under autocast (kept in float32 on purpose): the fused loss
    takes the head in autocast's dtype, as autocast hands it to nn.Linear (it raised a dtype
    error), with Hugging Face's loss and head gradient up to bf16 rounding. Also a head with a bias
    (nn.Linear's: the fused loss takes it), which autocast casts with the weight. Without autocast
    the dtypes differ in Hugging Face's model too, which raises: so does the patched one, rather
    than cast the float32 head to some dtype of its own choosing."""
    ref, model = tiny_model("llama", torch.bfloat16, seed=17), tiny_model("llama", torch.bfloat16, seed=17)
    if bias:
        g = torch.Generator().manual_seed(17)
        head_bias = torch.randn(VOCAB, generator=g)
    for m in (ref, model):
        m.lm_head.float()
        if bias:
            head = torch.nn.Linear(m.lm_head.in_features, VOCAB, bias=True)
            head.weight, head.bias = m.lm_head.weight, torch.nn.Parameter(head_bias.clone())
            m.lm_head = head
    lpt.patch(model)
    data = batch()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, ref_out = model(**data), ref_call(ref, **data)
    assert out.logits is None and calls.get("fused_linear_cross_entropy", 0) == 1
    assert abs(out.loss.item() - ref_out.loss.item()) <= 1e-2 * ref_out.loss.item()
    out.loss.backward()
    ref_out.loss.backward()
    assert model.lm_head.weight.grad.dtype == torch.float32
    assert rel_err(model.lm_head.weight.grad, ref.lm_head.weight.grad) <= 3e-2
    if bias:
        assert model.lm_head.bias.grad.dtype == torch.float32
        assert rel_err(model.lm_head.bias.grad, ref.lm_head.bias.grad) <= 3e-2
    with pytest.raises(RuntimeError):
        ref_call(ref, **data)
    with pytest.raises((RuntimeError, TypeError), match="dtype"):
        model(**data)


@pytest.mark.parametrize("mode", ["fused_linear_cross_entropy", "cross_entropy"])
def test_a_loss_function_set_on_the_model_is_used(mode, calls):
    """``model.loss_function = fn`` (Hugging Face's way to replace the loss) is honoured: the logits
    are built and ``fn`` computes the loss with the arguments Hugging Face's forward gives it (a
    strict signature: no ``cache``), as there (it was silently ignored)."""
    def half_loss(logits, labels, vocab_size, num_items_in_batch=None, ignore_index=-100, shift_labels=None):
        from transformers.loss.loss_utils import ForCausalLMLoss

        return 0.5 * ForCausalLMLoss(logits, labels, vocab_size, num_items_in_batch, ignore_index, shift_labels)

    ref = tiny_model("llama", seed=19)
    model = lpt.patch(tiny_model("llama", seed=19), fused_linear_cross_entropy=mode == "fused_linear_cross_entropy",
                      cross_entropy=mode == "cross_entropy")
    for m in (ref, model):
        m.loss_function = half_loss
    data = batch()
    out, ref_out = model(**data), ref_call(ref, **data)
    assert out.logits is not None and calls.get("fused_linear_cross_entropy", 0) == 0
    assert abs(out.loss.item() - ref_out.loss.item()) <= TOL * ref_out.loss.item()
    # With a cache passed in (use_cache=True), by the installed release's name for it: the cache goes
    # to the base model, not to the loss.
    name = CACHE_ARG
    out = model(**data, **{name: transformers.DynamicCache(config=model.config)}, use_cache=True)
    ref_out = ref_call(ref, **data, **{name: transformers.DynamicCache(config=ref.config)}, use_cache=True)
    assert abs(out.loss.item() - ref_out.loss.item()) <= TOL * ref_out.loss.item()
    assert out[name] is not None and out[name].get_seq_length() == ref_out[name].get_seq_length() > 0


def test_head_with_its_own_forward_builds_the_logits(calls):
    """An LM head whose instance ``forward`` was replaced (accelerate's device-map and offload hooks
    do this; its weight may then be a meta placeholder) is called, not bypassed by the fused loss."""
    ref, model = tiny_model("llama", seed=18), lpt.patch(tiny_model("llama", seed=18))
    for m in (ref, model):
        plain = m.lm_head.forward
        m.lm_head.forward = lambda h, plain=plain: plain(h) * 0.5
    data = batch()
    out, ref_out = model(**data), ref_call(ref, **data)
    assert calls.get("fused_linear_cross_entropy", 0) == 0
    assert abs(out.loss.item() - ref_out.loss.item()) <= TOL * ref_out.loss.item()


def test_trainer(tmp_path, calls):
    """Hugging Face Trainer with gradient accumulation (so ``num_items_in_batch`` reaches the
    forward): the patched model logs the same losses and ends with the same weights."""
    pytest.importorskip("accelerate")

    class Data(torch.utils.data.Dataset):
        def __len__(self):
            return 12

        def __getitem__(self, i):
            return {k: v[i % 2] for k, v in batch(100 + i).items()}  # rows with different label counts

    def run(patched: bool):
        model = tiny_model("llama", seed=10)
        if patched:
            lpt.patch(model)
        args = transformers.TrainingArguments(
            output_dir=str(tmp_path / ("patched" if patched else "ref")), max_steps=3, per_device_train_batch_size=2,
            gradient_accumulation_steps=2, learning_rate=1e-3, logging_steps=1, report_to=[], use_cpu=True,
            save_strategy="no", seed=0, disable_tqdm=True,
        )
        trainer = transformers.Trainer(model=model, args=args, train_dataset=Data())
        trainer.train()
        return model, [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]

    ref, ref_losses = run(False)
    model, losses = run(True)
    assert calls["fused_linear_cross_entropy"] == 6  # 3 steps x 2 micro-batches
    assert calls["_kwargs"]["fused_linear_cross_entropy"]["reduction"] == "sum"  # num_items_in_batch given
    assert len(losses) == 3
    for a, b in zip(losses, ref_losses):
        assert abs(a - b) <= TOL * abs(b), (losses, ref_losses)
    ref_params = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        assert rel_err(p, ref_params[name]) <= TOL, name


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_torch_compile_fullgraph(family):
    """A patched model trains under torch.compile(fullgraph=True): no graph break anywhere, ours
    included (aot_eager: the CPU fallback traced through AOTAutograd; on a GPU the kernels are
    custom ops, tested in the op tests)."""
    ref = tiny_model(family, seed=11)
    model = lpt.patch(tiny_model(family, seed=11))
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for step in range(2):
        data = batch(step)
        out = compiled(**data)
        assert out.logits is None
        ref_loss = ref_call(ref, **data).loss
        assert abs(out.loss.item() - ref_loss.item()) <= TOL * ref_loss.item()
        out.loss.backward()
        ref_loss.backward()
        assert_grads_match(model, ref)
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()


@pytest.fixture
def sdpa_calls(monkeypatch):
    """Records, for every call of ``F.scaled_dot_product_attention`` (compiled code replays the
    record), whether it got no mask and whether ``is_causal`` was set: ``(mask is None, is_causal)``."""
    seen = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def spy(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, **kwargs):
        seen.append((attn_mask is None, is_causal))
        return sdpa(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    return seen


def sdpa_model(family, seed, patched=True):
    model = tiny_model(family, seed=seed)
    model.config._attn_implementation = "sdpa"
    return lpt.patch(model) if patched else model


def packed_positions(batch_size=2, seq=19):
    """Position ids of two sequences packed in each row (8 tokens, then 11)."""
    return torch.cat([torch.arange(8), torch.arange(seq - 8)]).expand(batch_size, -1)


# Per family: what SDPA gets in each decoder layer of the tiny model with no mask from the caller
# (19 tokens): the plain causal mask skipped (True, True) on full-attention layers; Gemma-3's
# sliding layer (window 8) and Mistral's (window 16, every layer) keep Hugging Face's mask.
_NO_MASK_CALLS = {
    "llama": [(True, True)] * 2,
    "qwen3": [(True, True)] * 2,
    "granite": [(True, True)] * 2,
    "gemma3": [(False, False), (True, True)],
    "mistral": [(False, False)] * 2,
}


@pytest.mark.parametrize("use_cache", [False, True], ids=["no-cache", "cache"])
@pytest.mark.parametrize("family", sorted(_NO_MASK_CALLS))
def test_compiled_plain_causal_mask_skipped(family, use_cache, sdpa_calls):
    """Under torch.compile a patched SDPA model called without a mask or position ids builds no
    causal mask (SDPA's is_causal, as Hugging Face does in eager mode; compiled Hugging Face builds
    the full mask), on every step, with no graph break or recompilation, and the loss and
    gradients of eager Hugging Face."""
    torch._dynamo.reset()
    ref = sdpa_model(family, seed=21, patched=False)
    model = sdpa_model(family, seed=21)
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    frames = []
    for step in range(3):
        data = batch(step)
        del data["attention_mask"]
        data["labels"] = data["input_ids"]
        sdpa_calls.clear()
        out = compiled(**data, use_cache=use_cache)
        assert sdpa_calls == _NO_MASK_CALLS[family], f"step {step}: SDPA got {sdpa_calls}"
        sdpa_calls.clear()
        ref_loss = ref_call(ref, **data, use_cache=use_cache).loss
        assert sdpa_calls == _NO_MASK_CALLS[family], f"eager Hugging Face: SDPA got {sdpa_calls}"
        assert abs(out.loss.item() - ref_loss.item()) <= TOL * ref_loss.item()
        out.loss.backward()
        ref_loss.backward()
        assert_grads_match(model, ref)
        model.zero_grad()
        ref.zero_grad()
        frames.append(torch._dynamo.utils.counters["frames"]["ok"])
    assert frames[0] == frames[1] == frames[2], f"recompiled after the first step: frames compiled {frames}"


def test_compiled_unpatched_model_keeps_its_mask(sdpa_calls):
    """The family's create_causal_mask skips a mask only under a patched forward: an unpatched
    model of a patched family, compiled, builds Hugging Face's mask as before."""
    torch._dynamo.reset()
    sdpa_model("llama", seed=22)  # patches the family's modeling module
    model = sdpa_model("llama", seed=22, patched=False)
    ids = batch(0)["input_ids"]
    torch.compile(model, fullgraph=True, backend="aot_eager")(input_ids=ids, labels=ids)
    assert sdpa_calls == [(False, False)] * 2


@pytest.mark.parametrize("case", ["padding-mask", "packed-positions"])
def test_compiled_mask_kept_where_it_matters(case, sdpa_calls):
    """Under torch.compile a patched model keeps Hugging Face's mask where the caller's arguments
    make it more than causal (a left-padding mask; position ids of packed sequences, whose mask is
    block-diagonal): the loss and gradients of eager Hugging Face on the same arguments, which
    differ from the plain causal model's."""
    torch._dynamo.reset()
    ref = sdpa_model("llama", seed=23, patched=False)
    model = sdpa_model("llama", seed=23)
    data = batch(1)
    if case == "padding-mask":  # left padding, which tokens after it would attend to without the mask
        data["attention_mask"] = data["attention_mask"].flip(-1)
        data["labels"][1] = data["labels"][1].flip(-1)
    else:
        del data["attention_mask"]
        data["position_ids"] = packed_positions()
    out = torch.compile(model, fullgraph=True, backend="aot_eager")(**data)
    assert sdpa_calls == [(False, False)] * 2, f"SDPA got {sdpa_calls}"
    ref_loss = ref_call(ref, **data).loss
    plain = {k: v for k, v in data.items() if k not in ("attention_mask", "position_ids")}
    assert abs(ref_call(ref, **plain).loss.item() - ref_loss.item()) > 10 * TOL * ref_loss.item()  # the mask matters
    assert abs(out.loss.item() - ref_loss.item()) <= TOL * ref_loss.item()
    out.loss.backward()
    ref_loss.backward()
    assert_grads_match(model, ref)


@pytest.mark.parametrize("strict", [False, True], ids=["non-strict", "strict"])
def test_export_keeps_the_mask(strict):
    """torch.export of a patched model keeps Hugging Face's causal mask (an exported graph may run
    on other inputs, so transformers keeps it there): its SDPA calls take the mask. Exported under
    no_grad, as for inference (with gradients on, strict export fails on the MLP's
    activation-checkpoint region, as on any torch.utils.checkpoint under torch 2.13)."""
    model = sdpa_model("llama", seed=25).eval()
    ids = batch(0)["input_ids"]
    with torch.no_grad():
        exported = torch.export.export(model, (), {"input_ids": ids}, strict=strict)
    attention = [n for n in exported.graph.nodes if n.target is torch.ops.aten.scaled_dot_product_attention.default]
    assert len(attention) == 2
    for node in attention:
        mask = node.args[3] if len(node.args) > 3 else node.kwargs.get("attn_mask")
        assert mask is not None, f"exported without the mask: {node.format_node()}"
    with torch.no_grad():
        logits = exported.module()(input_ids=ids).logits
        assert rel_err(logits, ref_call(model, input_ids=ids).logits) <= TOL


def test_compiled_eager_attention_keeps_its_mask():
    """Eager attention has no is_causal: a patched eager-attention model under torch.compile,
    called without a mask or position ids, keeps Hugging Face's causal mask (the loss and gradients
    of eager Hugging Face, which differ from those of the same model attending to every token)."""
    torch._dynamo.reset()
    ref = tiny_model("llama", seed=26)
    model = lpt.patch(tiny_model("llama", seed=26))
    ids = batch(0)["input_ids"]
    out = torch.compile(model, fullgraph=True, backend="aot_eager")(input_ids=ids, labels=ids)
    ref_loss = ref_call(ref, input_ids=ids, labels=ids).loss
    assert abs(out.loss.item() - ref_loss.item()) <= TOL * ref_loss.item()
    out.loss.backward()
    ref_loss.backward()
    assert_grads_match(model, ref)


def test_plain_causal_only_without_mask_functions():
    """The mask is skipped only for SDPA, a causal config and none of the functions or block ids
    that change the causal mask (Hugging Face's own conditions for skipping it)."""
    from liger_portable.transformers import _mask

    config = tiny_config("llama")
    config._attn_implementation = "sdpa"
    assert _mask.plain_causal({"config": config})
    for key in ("or_mask_function", "and_mask_function", "block_sequence_ids"):
        assert not _mask.plain_causal({"config": config, key: object()}), key
    config._attn_implementation = "flash_attention_2"
    assert not _mask.plain_causal({"config": config})
    assert not _mask.plain_causal({})


def test_default_positions_flag_reset_after_error():
    """The flag a patched forward sets for its base model's call is set back when the call
    raises, so a later compiled trace of another call does not skip a mask on it."""
    from liger_portable.transformers import _mask

    model = sdpa_model("llama", seed=24)
    ids = batch(0)["input_ids"]
    with pytest.raises(ValueError):
        model(input_ids=ids, inputs_embeds=model.model.embed_tokens(ids))  # Hugging Face: one of the two
    assert _mask.default_positions_flag() is False
    model(input_ids=ids)
    assert _mask.default_positions_flag() is False


@pytest.mark.gpu
@pytest.mark.parametrize("under_compile", ["inductor", "kernels"])
@pytest.mark.parametrize("mode", [None, "reduce-overhead", "max-autotune-no-cudagraphs"])
def test_torch_compile_inductor_gpu(monkeypatch, launches, mode, under_compile):
    """A patched model under torch.compile with Inductor on the GPU, in the default mode, with CUDA
    graphs (our ops capture: no host synchronisation inside them) and with max-autotune: no graph
    break (fullgraph), no recompilation after the first step, the loss and gradients of eager
    Hugging Face; and where the kernel ops are triton_ops (CUDA), a compiled step launches the
    per-layer kernels from the compiled code: none goes through liger_portable's Python launcher
    after the first step. Under either UNDER_COMPILE choice (Inductor's norms, GLU and RoPE, or
    ours)."""
    from liger_portable import functional
    from liger_portable.ops import launching

    monkeypatch.setattr(functional, "UNDER_COMPILE", under_compile)
    torch._dynamo.reset()
    dev = torch.device("cuda")
    ref = tiny_model("llama", seed=14).to(dev)
    model = lpt.patch(tiny_model("llama", seed=14).to(dev))
    compiled = torch.compile(model, fullgraph=True, mode=mode)
    frames = []
    for step in range(3):
        data = {k: v.to(dev) for k, v in batch(step).items()}
        launches.clear()
        if mode == "reduce-overhead":
            torch.compiler.cudagraph_mark_step_begin()
        out = compiled(**data)
        out.loss.backward()
        ref_loss = ref_call(ref, **data).loss
        ref_loss.backward()
        assert abs(out.loss.item() - ref_loss.item()) <= TOL * ref_loss.item()
        assert_grads_match(model, ref)
        model.zero_grad()
        ref.zero_grad()
        frames.append(torch._dynamo.utils.counters["frames"]["ok"])
    assert frames[1] == frames[2] == frames[0], f"recompiled after the first step: frames compiled {frames}"
    if launching.inductor_launches():
        if mode != "reduce-overhead":  # CUDA graphs replay the loss's launches too
            assert launches, "the launch counter saw no launch (the loss's kernels run through it)"
        per_layer = [k for k in launches if k.startswith(("_rms_norm", "_layer_norm", "_glu", "_rope"))]
        assert per_layer == [], f"launched through Python under torch.compile: {sorted(set(per_layer))}"


@pytest.mark.parametrize("ran_before", [False, True], ids=["fresh", "after-a-step"])
def test_patch_compiled_model(ran_before, calls):
    """patch() on a model already wrapped by torch.compile patches the model inside, the fused loss
    included (logits None), whether or not the wrapper ran before; the wrapper is returned."""
    ref = tiny_model("llama", seed=12)
    model = tiny_model("llama", seed=12)
    compiled = torch.compile(model, backend="eager")
    if ran_before:
        assert compiled(**batch(5)).logits is not None  # compiled unpatched
    assert lpt.patch(compiled) is compiled
    assert type(model.model.norm).__name__ == "RMSNorm" and type(model.model.norm).__module__.startswith("liger_portable")
    data = batch(1)
    out = compiled(**data)
    assert out.logits is None and calls.get("fused_linear_cross_entropy", 0) == 1
    ref_out = ref_call(ref, **data)
    assert abs(out.loss.item() - ref_out.loss.item()) <= TOL * ref_out.loss.item()
    out.loss.backward()
    ref_out.loss.backward()
    assert_grads_match(model, ref)


def test_patch_compiled_base_model():
    """patch() on a compiled base model (no LM head, so no loss to fuse) patches the model inside
    as it would the bare one: its norms, MLPs and RoPE, Hugging Face's hidden states, and no
    warning (the wrapper is not mistaken for a causal LM of a class of its own)."""
    import warnings

    ref = tiny_model("llama", seed=12).model
    base = tiny_model("llama", seed=12).model
    compiled = torch.compile(base, backend="eager")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert lpt.patch(compiled) is compiled
    assert type(base.norm).__module__.startswith("liger_portable")
    ids = batch(1)["input_ids"]
    with torch.no_grad():
        h, h_ref = base(input_ids=ids).last_hidden_state, ref_call(ref, input_ids=ids).last_hidden_state
    assert rel_err(h, h_ref) <= TOL


# --------------------------------------------------------------------------- class-level patching


@pytest.mark.parametrize("name", sorted(LIGER_FUNCTIONS))
def test_liger_kernel_functions(name, calls):
    """Each ``apply_liger_kernel_to_*`` has Liger-Kernel's signature and defaults, and a model
    built afterwards is built from liger_portable's modules, with Hugging Face's weights (the same
    initialisation) and Hugging Face's loss, and runs every fused op of its defaults (RoPE and
    Mixtral's experts, which no module class shows, included)."""
    family, defaults = LIGER_FUNCTIONS[name]
    fn = getattr(lpt, name)
    params = inspect.signature(fn).parameters
    assert {k: p.default for k, p in params.items()} == defaults
    assert list(params) == list(defaults)

    ref = tiny_model(family, seed=12)
    fn()
    model = tiny_model(family, seed=12)
    fam = _patch.FAMILIES[family]
    names = {type(m).__name__ for m in model.modules()}
    assert fam.norm not in names and (fam.mlp is None or fam.mlp not in names), names
    sd, ref_sd = model.state_dict(), ref.state_dict()
    assert list(sd) == list(ref_sd)
    for k in sd:
        assert torch.equal(sd[k], ref_sd[k]), f"{k} initialised differently"
    data = batch(5)
    out, ref_out = model(**data), ref_call(ref, **data)
    assert (out.logits is None) == defaults["fused_linear_cross_entropy"]
    assert abs(out.loss.item() - ref_out.loss.item()) <= TOL * ref_out.loss.item()
    loss_op = "fused_linear_cross_entropy" if defaults["fused_linear_cross_entropy"] else "cross_entropy"
    for op in ("rms_norm", "rope", "geglu" if fam.glu == "geglu" else "swiglu", loss_op):
        assert calls.get(op, 0) > 0, f"{op} was not called; calls: {calls}"

    _patch.revert()
    plain = tiny_model(family, seed=12)
    assert fam.norm in {type(m).__name__ for m in plain.modules()}


@pytest.mark.parametrize("name", sorted(LIGER_FUNCTIONS))
def test_liger_kernel_functions_honour_each_option(name):
    """Each ``apply_liger_kernel_to_*`` option turned off leaves what it replaces as Hugging Face's
    (and only that): the modeling module's ``apply_rotary_pos_emb``, its RMSNorm class, its MLP
    class (Mixtral: the experts' ``_apply_gate``), the causal LM's ``forward``."""
    family, defaults = LIGER_FUNCTIONS[name]
    fn, fam = getattr(lpt, name), _patch.FAMILIES[family]
    modeling = fam.modeling
    glu = "geglu" if "geglu" in defaults else "swiglu"
    targets = {
        "rope": (modeling, "apply_rotary_pos_emb"),
        "rms_norm": (modeling, fam.norm),
        glu: (modeling.MixtralExperts, "_apply_gate") if fam.glu == "experts" else (modeling, fam.mlp),
        "loss": (getattr(modeling, fam.causal_lm), "forward"),
    }
    hugging_face = {option: getattr(*target) for option, target in targets.items()}
    for off in targets:
        _patch.revert()
        fn(**({"cross_entropy": False, "fused_linear_cross_entropy": False} if off == "loss" else {off: False}))
        for option, target in targets.items():
            kept = getattr(*target) is hugging_face[option]
            assert kept == (option == off), f"{off}=False: {option} {'kept' if kept else 'replaced'}"


def test_apply_with_model_and_revert():
    """``model=`` patches an existing instance too; ``revert`` restores Hugging Face's classes."""
    from transformers.models.llama import modeling_llama

    originals = (modeling_llama.LlamaRMSNorm, modeling_llama.LlamaMLP, modeling_llama.apply_rotary_pos_emb,
                 modeling_llama.LlamaForCausalLM.forward)
    ref = tiny_model("llama", seed=13)
    model = tiny_model("llama", seed=13)
    lpt.apply_liger_kernel_to_llama(model=model)
    assert modeling_llama.LlamaRMSNorm is lpt.RMSNorm and modeling_llama.LlamaMLP is lpt.SwiGLUMLP
    assert not any(type(m) in originals[:2] for m in model.modules())
    data = batch(6)
    out = model(**data)
    assert out.logits is None
    assert abs(out.loss.item() - ref_call(ref, **data).loss.item()) <= TOL * out.loss.item()
    _patch.revert()
    assert (modeling_llama.LlamaRMSNorm, modeling_llama.LlamaMLP, modeling_llama.apply_rotary_pos_emb,
            modeling_llama.LlamaForCausalLM.forward) == originals


def test_apply_with_model_replaces_its_own_forward(calls):
    """``apply_liger_kernel_to_llama(model=...)`` on a model that has a forward of its own (here from
    an earlier ``patch(model, cross_entropy=True)``) gives it the loss asked for now: the fused
    loss (no logits), with Hugging Face's loss; the class-level forward alone would not reach it."""
    ref = tiny_model("llama", seed=26)
    model = lpt.patch(tiny_model("llama", seed=26), fused_linear_cross_entropy=False, cross_entropy=True)
    lpt.apply_liger_kernel_to_llama(model=model)
    data = batch(13)
    out, ref_out = model(**data), ref_call(ref, **data)
    assert out.logits is None and calls.get("fused_linear_cross_entropy", 0) == 1
    assert abs(out.loss.item() - ref_out.loss.item()) <= TOL * ref_out.loss.item()


# --------------------------------------------------------------------------- errors


def test_both_losses_is_an_error():
    model = tiny_model("llama")
    with pytest.raises(ValueError, match="cross_entropy and fused_linear_cross_entropy are mutually exclusive"):
        lpt.patch(model, cross_entropy=True)
    with pytest.raises(ValueError, match="mutually exclusive"):
        lpt.apply_liger_kernel_to_granite(fused_linear_cross_entropy=True)
    lpt.apply_liger_kernel_to_granite(cross_entropy=False, fused_linear_cross_entropy=True)  # fine here
    assert "forward" not in vars(model) and any(type(m).__name__ == "LlamaRMSNorm" for m in model.modules())
    with pytest.raises(TypeError, match="rope must be True or False"):
        lpt.patch(model, rope=1)


def test_unsupported_model_type_lists_the_supported_ones():
    fake = types.SimpleNamespace(config=types.SimpleNamespace(model_type="gpt2"))
    with pytest.raises(ValueError, match="'gpt2' is not supported") as err:
        lpt.patch(fake)
    for model_type in ("llama", "mistral", "mixtral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text", "phi3", "granite"):
        assert model_type in str(err.value)
    assert set(lpt.SUPPORTED_MODEL_TYPES) == {
        "llama", "mistral", "mixtral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text", "phi3", "granite"
    }
    with pytest.raises(ValueError, match="Gemma3ForCausalLM"):
        lpt.patch(types.SimpleNamespace(config=types.SimpleNamespace(model_type="gemma3")))
    with pytest.raises(TypeError, match="PreTrainedModel"):
        lpt.patch(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="not mistral"):
        lpt.apply_liger_kernel_to_mistral(model=tiny_model("llama"))


@pytest.mark.parametrize(
    "family, act",
    [("llama", "relu"), ("gemma2", "relu"), ("llama", "gelu_pytorch_tanh"), ("gemma2", "silu"),
     ("mixtral", "gelu_pytorch_tanh")],
)
def test_other_activation_is_an_error(family, act):
    """The fused MLP computes one activation: another one is refused, and nothing is changed. Also
    the activation the other fused MLP computes (tanh GELU for a SwiGLU family, SiLU for a GeGLU
    one), and Mixtral's experts."""
    config = tiny_config(family)
    key = "hidden_activation" if family == "gemma2" else "hidden_act"
    setattr(config, key, act)
    model = type(tiny_model(family))(config)
    types_before = [type(m) for m in model.modules()]
    with pytest.raises(ValueError, match=f"swiglu=True fuses .*config.{key}='{act}'; pass swiglu=False"):
        lpt.patch(model)
    apply, option = {"llama": (lpt.apply_liger_kernel_to_llama, "swiglu"), "gemma2": (lpt.apply_liger_kernel_to_gemma2, "geglu"),
                     "mixtral": (lpt.apply_liger_kernel_to_mixtral, "swiglu")}[family]
    with pytest.raises(ValueError, match=f"{option}=True fuses .*; pass {option}=False"):
        apply(model=model)
    assert [type(m) for m in model.modules()] == types_before and "forward" not in vars(model)
    lpt.patch(model, swiglu=False)  # the rest still applies
    assert any(type(m) in (lpt.RMSNorm, lpt.GemmaStyleRMSNorm) for m in model.modules())
