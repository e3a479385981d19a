"""The zoo of ``tests/clipping/test_zoo.py`` under activation checkpointing and the chunked LM loss (issue #24; not a
test, run by hand).

Every zoo model (its own factory, data and tolerance), plus the ``EXTRA`` architectures that support gradient
checkpointing and that the zoo lacks, × {``use_reentrant=False``, ``True``} × {flat (``flat_clipping_passes="auto"``:
two passes under checkpointing), per-layer} (× ``lm_loss_chunk_size`` ∈ {off, 3} for causal LMs), one DP step
(σ = 0, q = 1, SGD lr 1, two micro-batches of two) against the float64 oracle of ``tests/helpers/oracle.py`` (each
example's gradient of the model's own loss on a batch of one, without checkpointing), as ``helpers.check_exact``.

Each run is classified:

* ``exact``    every parameter's update within 1e-6 of its largest target entry, or of 1e-6 × the largest entry of
  any parameter for a gradient that is zero in exact arithmetic (BERT's key bias). Two-pass flat: pass 2 is the
  model's own batched backward, so agreement is to round-off of float32 computed inside (Llama's RMSNorm), ~1e-7;
* ``exact~``   within 1e-4 (a model that computes in float32 inside: the zoo's ‡ models);
* ``WRONG``    the update differs (silent: the worst);
* ``refused``  hf_dp raised ``UnsupportedLayerError`` or a ``ValueError`` of its own, message kept;
* ``n/a``      the model does not support gradient checkpointing (``gradient_checkpointing_enable`` refuses);
* ``crash``    another exception, or a run over ``--timeout`` seconds.

``ckpt``: how many module forwards ran inside the backward (the segments' recomputes; 0 means checkpointing was on but
re-ran nothing, so the row proves nothing about it).

Usage (worktree root, one thread)::

    PYTHONPATH=$PWD OMP_NUM_THREADS=1 python benchmarks/zoo_sweep.py --out /tmp/zoo_sweep.jsonl [--only llama,t5]
    python benchmarks/zoo_sweep.py --table /tmp/zoo_sweep.jsonl
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import io
import json
import signal
import sys
import tempfile
import time
import traceback
import warnings
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO / "tests"), str(REPO / "tests" / "clipping")]

import test_zoo as zoo  # noqa: E402
import torch  # noqa: E402
import transformers as tf  # noqa: E402
from helpers import dp_args, per_example_grads, sorted_norms  # noqa: E402
from helpers.oracle import group_clipped_sum  # noqa: E402

from hf_dp import DPTrainer, UnsupportedLayerError  # noqa: E402

# Architectures with supports_gradient_checkpointing that the zoo lacks, built tiny (decoders: the zoo's ``dec``).
EXTRA_DECODERS = {
    "mistral": zoo.dec(tf.MistralConfig, tf.MistralForCausalLM),
    "qwen3": zoo.dec(tf.Qwen3Config, tf.Qwen3ForCausalLM, head_dim=8),
    "phi3": zoo.dec(tf.Phi3Config, tf.Phi3ForCausalLM, resid_pdrop=0.0, embd_pdrop=0.0, attention_dropout=0.0),
    "stablelm": zoo.dec(tf.StableLmConfig, tf.StableLmForCausalLM, hidden_dropout=0.0, attention_dropout=0.0),
    "gpt_neox": zoo.dec(tf.GPTNeoXConfig, tf.GPTNeoXForCausalLM, hidden_dropout=0.0, attention_dropout=0.0),
    "granite": zoo.dec(tf.GraniteConfig, tf.GraniteForCausalLM, logits_scaling=4.0),
    "starcoder2": zoo.dec(tf.Starcoder2Config, tf.Starcoder2ForCausalLM, residual_dropout=0.0, embedding_dropout=0.0,
                          attention_dropout=0.0),
    "smollm3": zoo.dec(tf.SmolLM3Config, tf.SmolLM3ForCausalLM),
    "qwen3_moe": zoo.dec(tf.Qwen3MoeConfig, tf.Qwen3MoeForCausalLM, head_dim=8, num_experts=4, num_experts_per_tok=2,
                         moe_intermediate_size=8, experts_implementation="eager"),
    "gptj": lambda: tf.GPTJForCausalLM(tf.GPTJConfig(
        vocab_size=zoo.VOCAB, n_embd=16, n_layer=1, n_head=2, rotary_dim=4, n_positions=32, resid_pdrop=0.0,
        embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)),
    "bloom": lambda: tf.BloomForCausalLM(tf.BloomConfig(
        vocab_size=zoo.VOCAB, hidden_size=16, n_layer=1, n_head=2, hidden_dropout=0.0, attention_dropout=0.0,
        bos_token_id=0, eos_token_id=0, pad_token_id=0)),
    "gpt_bigcode": lambda: tf.GPTBigCodeForCausalLM(tf.GPTBigCodeConfig(
        vocab_size=zoo.VOCAB, n_embd=16, n_layer=1, n_head=2, n_positions=32, resid_pdrop=0.0, embd_pdrop=0.0,
        attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)),
}
EXTRA_ENCODERS = {
    "xlm_roberta": zoo.enc(tf.XLMRobertaConfig, tf.XLMRobertaForSequenceClassification, pad_token_id=1,
                           max_position_embeddings=40),
    "albert": zoo.enc(tf.AlbertConfig, tf.AlbertForSequenceClassification, embedding_size=8,
                      classifier_dropout_prob=0.0),
    "modernbert": zoo.enc(tf.ModernBertConfig, tf.ModernBertForSequenceClassification, embedding_dropout=0.0,
                          mlp_dropout=0.0, attention_dropout=0.0, classifier_dropout=0.0, global_attn_every_n_layers=1,
                          local_attention=4),
}
EXTRA_SEQ2SEQ = {
    "pegasus": zoo.bart_like(tf.PegasusConfig, tf.PegasusForConditionalGeneration),
    "marian": zoo.bart_like(tf.MarianConfig, tf.MarianMTModel, decoder_vocab_size=zoo.VOCAB),
    "m2m100": zoo.bart_like(tf.M2M100Config, tf.M2M100ForConditionalGeneration),
    "mt5": lambda: tf.MT5ForConditionalGeneration(tf.MT5Config(
        vocab_size=zoo.VOCAB, d_model=16, d_kv=8, d_ff=24, num_layers=1, num_decoder_layers=1, num_heads=2,
        dropout_rate=0.0, pad_token_id=0, eos_token_id=1, decoder_start_token_id=0)),
}
EXTRA_VISION = {
    "dinov2": lambda: tf.Dinov2ForImageClassification(tf.Dinov2Config(
        image_size=8, patch_size=4, num_channels=3, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
        mlp_ratio=2, num_labels=3, layerscale_value=1.0, **zoo.SMALL)),
}


def cases() -> list[tuple[str, str, object, object]]:
    """(name, kind, factory, data) for the zoo's cases and the extras; kind: decoder, encoder, seq2seq, vision,
    audio (with "+" for an extra)."""
    kinds = {**{k: "decoder" for k in zoo.DECODERS}, **{k: "encoder" for k in zoo.ENCODERS},
             **{k: "seq2seq" for k in zoo.SEQ2SEQ}, **{k: "vision" for k in zoo.VISION},
             **{k: "audio" for k in zoo.AUDIO}}
    out = [(name, kinds[name], make, data) for name, make, data in zoo.CASES]
    out += [(k, "decoder+", f, zoo.decoder_data) for k, f in EXTRA_DECODERS.items()]
    out += [(k, "encoder+", f, zoo.encoder_data) for k, f in EXTRA_ENCODERS.items()]
    out += [(k, "seq2seq+", f, zoo.seq2seq_data) for k, f in EXTRA_SEQ2SEQ.items()]
    out += [(k, "vision+", f, zoo.image_cls) for k, f in EXTRA_VISION.items()]
    return out


class BackwardForwards:
    """Counts module forwards that run inside a backward pass (activation checkpointing's recomputes)."""

    def __init__(self):
        self.count = 0
        self.handle = torch.nn.modules.module.register_module_forward_pre_hook(self._hook)

    def _hook(self, _module, _args):
        if torch._C._current_graph_task_id() != -1:
            self.count += 1

    def remove(self):
        self.handle.remove()


class Timeout(Exception):
    pass


def _alarm(*_):
    raise Timeout


def run_one(name: str, kind: str, make, data, reentrant: bool, clipping: str, chunk: int | None,
            timeout: int, passes: str = "auto") -> dict:
    row = dict(model=name, kind=kind, reentrant=reentrant, clipping=clipping if passes == "auto" else f"flat/{passes}",
               chunk=chunk)
    counter = BackwardForwards()
    cpu0 = time.process_time()
    signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(timeout)
    stage = "build"
    try:
        torch.manual_seed(0)
        model = make().double()
        if getattr(model, "config", None) is not None:
            model.config.use_cache = False
        rows = data()
        stage = "oracle"
        grads = per_example_grads(model, rows)
        n = len(grads)
        trainable = list(grads[0])
        max_norm = sorted_norms(grads, trainable)[n // 2 - 1] + 1e-9
        extra = dict(zoo.IMAGE_LOSS) if kind.startswith("vision") else {}
        kw = dict(clipping=clipping, poisson_sampling=True, gradient_checkpointing=True,
                  gradient_checkpointing_kwargs={"use_reentrant": reentrant})
        if not hasattr(model, "gradient_checkpointing_enable"):  # a module of one's own (SiglipPooled): enabled on
            for sub in model.modules():  # its transformers models, as the Trainer cannot ("auto" sees it there)
                if isinstance(sub, tf.PreTrainedModel):
                    sub.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
            kw.update(gradient_checkpointing=False, gradient_checkpointing_kwargs=None)
        if chunk:
            kw["lm_loss_chunk_size"] = chunk
        if passes != "auto":
            kw["flat_clipping_passes"] = passes
        stage = "trainer"
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with tempfile.TemporaryDirectory() as tmp:
                args = dp_args(tmp, n // 2, 2, max_norm, **kw)
                trainer = DPTrainer(model=model, args=args, train_dataset=rows, **extra)
                if clipping == "flat":
                    groups, thresholds = [trainable], [max_norm]
                else:
                    groups = [g.params for g in trainer.group_clipper.groups]
                    thresholds = [sorted_norms(grads, names)[n // 2 - 1] + 1e-9 for names in groups]
                    trainer.group_clipper.thresholds = torch.tensor(thresholds, dtype=torch.float64)
                expected = group_clipped_sum(grads, groups, thresholds)
                before = {k: p.detach().clone() for k, p in model.named_parameters()}
                counter.count = 0
                stage = "train"
                with contextlib.redirect_stdout(io.StringIO()):
                    trainer.train()
        errs, diffs, scales = {}, {}, {}
        for k, p in model.named_parameters():
            target = expected[k] / n if p.requires_grad else torch.zeros_like(p)
            diffs[k] = float((before[k] - p.detach() - target).abs().max())
            scales[k] = float(target.abs().max())
        floor = 1e-6 * max(scales.values())  # a gradient that is zero in exact arithmetic (BERT's key bias) is noise
        for k in diffs:
            scale = max(scales[k], floor)
            errs[k] = diffs[k] / scale if scale > 0 else (0.0 if diffs[k] == 0 else float("inf"))
        worst = max(errs, key=errs.get)
        err = errs[worst]
        moved = any(float(e.abs().max()) > 0 for e in expected.values())
        row.update(err=err, worst=worst, moved=moved, ckpt=counter.count,
                   result="exact" if err <= 1e-6 else "exact~" if err <= 1e-4 else "WRONG")
    except Timeout:
        row.update(result="crash", error=f"timeout after {timeout} s in {stage}")
    except BaseException as exc:  # noqa: BLE001 - classified below
        tb = traceback.extract_tb(exc.__traceback__)
        where = next((f"{Path(f.filename).name}:{f.lineno}" for f in reversed(tb) if "/hf_dp/" in f.filename), "")
        msg = f"{type(exc).__name__}: {exc}"
        if "does not support gradient checkpointing" in msg or "does not support activation checkpointing" in msg:
            result = "n/a"
        elif stage in ("build", "oracle"):
            result = "harness"
        elif isinstance(exc, UnsupportedLayerError) or (isinstance(exc, ValueError) and where):
            result = "refused"
        else:
            result = "crash"
        row.update(result=result, error=msg[:600], where=where, stage=stage)
    finally:
        signal.alarm(0)
        counter.remove()
        torch.set_default_dtype(torch.float32)  # XGLM's factory sets float64
    row["cpu_s"] = round(time.process_time() - cpu0, 1)
    return row


# ------------------------------------------------------------------------ LoRA as QLoRA users enable it; DP-SFT
LORA_DECODERS = {  # 2 layers; LoRA targets
    "llama": (zoo.dec(tf.LlamaConfig, tf.LlamaForCausalLM, num_hidden_layers=2), ["q_proj", "v_proj", "down_proj"]),
    "qwen2": (zoo.dec(tf.Qwen2Config, tf.Qwen2ForCausalLM, num_hidden_layers=2), ["q_proj", "v_proj", "down_proj"]),
    "gemma2": (zoo.dec(tf.Gemma2Config, tf.Gemma2ForCausalLM, num_hidden_layers=2, head_dim=8),
               ["q_proj", "v_proj", "down_proj"]),
    "mistral": (zoo.dec(tf.MistralConfig, tf.MistralForCausalLM, num_hidden_layers=2),
                ["q_proj", "v_proj", "down_proj"]),
    "gpt2": (lambda: tf.GPT2LMHeadModel(tf.GPT2Config(
        n_layer=2, n_embd=16, n_head=2, vocab_size=zoo.VOCAB, n_positions=32, resid_pdrop=0.0, embd_pdrop=0.0,
        attn_pdrop=0.0, bos_token_id=0, eos_token_id=0, pad_token_id=0)), ["c_attn", "c_proj"]),
}


def lora_model(name: str, how: str, tmp: str):
    """``how``: "nf4" (bitsandbytes 4-bit base from ``from_pretrained``, ``prepare_model_for_kbit_training`` — which
    turns checkpointing on, reentrant, with ``enable_input_require_grads`` — float32), "manual_reentrant" /
    "manual_nonreentrant" (float64 base, ``gradient_checkpointing_enable`` + ``enable_input_require_grads``), then
    ``get_peft_model`` with LoRA's B drawn from N(0, 0.5²)."""
    from peft import LoraConfig, TaskType, get_peft_model, prepare_model_for_kbit_training

    make, targets = LORA_DECODERS[name]
    torch.manual_seed(0)
    base = make()
    if how == "nf4":
        base.save_pretrained(tmp + "/base")
        quant = tf.BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                      bnb_4bit_compute_dtype=torch.float32)
        base = type(base).from_pretrained(tmp + "/base", quantization_config=quant, device_map="cpu",
                                          dtype=torch.float32)
        base = prepare_model_for_kbit_training(base)
    else:
        base = base.double()
        base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": how == "manual_reentrant"})
        base.enable_input_require_grads()
    base.config.use_cache = False
    model = get_peft_model(base, LoraConfig(task_type=TaskType.CAUSAL_LM, r=4, lora_alpha=8, lora_dropout=0.0,
                                            target_modules=targets))
    with torch.no_grad():
        for k, p in model.named_parameters():
            if "lora_B" in k:
                p.normal_(0.0, 0.5)
    return model


def _compare(model, grads, expected, before, n, float32: bool = False) -> dict:
    """Classify the update against the oracle; ``float32`` (a quantised base computes in float32, the oracle too):
    errors relative to max(the parameter's largest target, 1e-4 × any parameter's), exact~ to 1e-3 (round-off on a
    parameter whose gradient is small next to the others': the same error with checkpointing off)."""
    errs, diffs, scales = {}, {}, {}
    for k, p in model.named_parameters():
        if k not in before:
            continue
        target = expected[k] / n if p.requires_grad else torch.zeros_like(p)
        diffs[k] = float((before[k] - p.detach() - target.to(p.dtype)).abs().max())
        scales[k] = float(target.abs().max())
    floor = (1e-4 if float32 else 1e-6) * max(scales.values())
    for k in diffs:
        scale = max(scales[k], floor)
        errs[k] = diffs[k] / scale if scale > 0 else (0.0 if diffs[k] == 0 else float("inf"))
    worst = max(errs, key=errs.get)
    err = errs[worst]
    result = "exact" if err <= 1e-6 else "exact~" if err <= (1e-3 if float32 else 1e-4) else "WRONG"
    return dict(err=err, worst=worst, result=result)


def _oracle(trainer, grads, clipping, n):
    trainable = list(grads[0])
    if clipping == "flat":
        groups, thresholds = [trainable], [trainer.args.per_sample_max_grad_norm]
    else:
        groups = [g.params for g in trainer.group_clipper.groups]
        thresholds = [sorted_norms(grads, names)[n // 2 - 1] + 1e-9 for names in groups]
        trainer.group_clipper.thresholds = torch.tensor(thresholds, dtype=torch.float64)
    return group_clipped_sum(grads, groups, thresholds)


def _classify_error(exc: BaseException, stage: str) -> dict:
    tb = traceback.extract_tb(exc.__traceback__)
    where = next((f"{Path(f.filename).name}:{f.lineno}" for f in reversed(tb) if "/hf_dp/" in f.filename), "")
    msg = f"{type(exc).__name__}: {exc}"
    if stage in ("build", "oracle"):
        result = "harness"
    elif isinstance(exc, UnsupportedLayerError) or (isinstance(exc, ValueError) and where):
        result = "refused"
    else:
        result = "crash"
    return dict(result=result, error=msg[:600], where=where, stage=stage)


def _lora_step(name: str, how: str, clipping: str, chunk: int | None, tmp: str, checkpointing: bool = True):
    """One DP step of ``lora_model(name, how)`` against the oracle (``checkpointing=False``: turned off again on the
    base, the float32 baseline); returns ``_compare``'s classification."""
    model = lora_model(name, how, tmp)
    if not checkpointing:
        model.get_base_model().gradient_checkpointing_disable()
    rows = zoo.decoder_data()
    grads = per_example_grads(model, rows)
    n = len(grads)
    max_norm = sorted_norms(grads, list(grads[0]))[n // 2 - 1] + 1e-9
    kw = dict(clipping=clipping, poisson_sampling=True, **({"lm_loss_chunk_size": chunk} if chunk else {}))
    trainer = DPTrainer(model=model, args=dp_args(tmp, n // 2, 2, max_norm, **kw), train_dataset=rows)
    expected = _oracle(trainer, grads, clipping, n)
    before = {k: p.detach().clone() for k, p in model.named_parameters() if p.requires_grad}
    with contextlib.redirect_stdout(io.StringIO()):
        trainer.train()
    return _compare(model, grads, expected, before, n, float32=how == "nf4")


def run_lora(name: str, how: str, clipping: str, chunk: int | None, timeout: int) -> dict:
    """LoRA with checkpointing enabled on the model (``lora_model``). The nf4 base computes in float32 (oracle too):
    its row also runs the same step with checkpointing off; exact~ when checkpointing changes the error by < 10 %."""
    row = dict(model=f"lora:{name}", kind="lora", reentrant=how, clipping=clipping, chunk=chunk)
    counter = BackwardForwards()
    cpu0 = time.process_time()
    signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(timeout)
    stage = "train"
    try:
        with tempfile.TemporaryDirectory() as tmp, warnings.catch_warnings():
            warnings.simplefilter("ignore")
            row.update(_lora_step(name, how, clipping, chunk, tmp))
            row["ckpt"] = counter.count
            if how == "nf4":
                base = _lora_step(name, how, clipping, chunk, tmp, checkpointing=False)
                row["err_without_checkpointing"] = base["err"]
                if abs(row["err"] - base["err"]) <= 0.1 * base["err"] + 1e-6:
                    row["result"] = "exact~"
    except Timeout:
        row.update(result="crash", error=f"timeout after {timeout} s")
    except BaseException as exc:  # noqa: BLE001 - classified
        row.update(_classify_error(exc, stage))
    finally:
        signal.alarm(0)
        counter.remove()
    row["cpu_s"] = round(time.process_time() - cpu0, 1)
    return row


def run_sft(name: str, clipping: str, chunk: int | None, timeout: int) -> dict:
    """DPSFTTrainer with trl's defaults (``gradient_checkpointing=True``), ``packing=True`` (padding-free rows),
    against each example's own loss with trl's labels on a batch of one."""
    from helpers.chat import make_sft_trainer, sft_args, sft_dataset, sft_row_grads

    row = dict(model=f"sft:{name}", kind="dp_sft_packed", reentrant="trl default", clipping=clipping, chunk=chunk)
    counter = BackwardForwards()
    cpu0 = time.process_time()
    signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(timeout)
    stage = "build"
    try:
        with tempfile.TemporaryDirectory() as tmp, warnings.catch_warnings():
            warnings.simplefilter("ignore")
            torch.manual_seed(0)
            model = LORA_DECODERS[name][0]().double()
            kw = dict(packing=True, clipping=clipping, **({"lm_loss_chunk_size": chunk} if chunk else {}))
            stage = "trainer"
            trainer = make_sft_trainer(model, sft_dataset("prompt_completion"), sft_args(tmp, **kw))
            assert trainer.args.gradient_checkpointing and trainer.padding_free
            stage = "oracle"
            grads = sft_row_grads(trainer, list(range(4)))
            n = len(grads)
            trainer.args.per_sample_max_grad_norm = sorted_norms(grads, list(grads[0]))[n // 2 - 1] + 1e-9
            expected = _oracle(trainer, grads, clipping, n)
            before = {k: p.detach().clone() for k, p in model.named_parameters() if p.requires_grad}
            counter.count = 0
            stage = "train"
            with contextlib.redirect_stdout(io.StringIO()):
                trainer.train()
        row.update(_compare(model, grads, expected, before, n), ckpt=counter.count)
    except Timeout:
        row.update(result="crash", error=f"timeout after {timeout} s in {stage}")
    except BaseException as exc:  # noqa: BLE001 - classified
        row.update(_classify_error(exc, stage))
    finally:
        signal.alarm(0)
        counter.remove()
    row["cpu_s"] = round(time.process_time() - cpu0, 1)
    return row


def jobs(only: list[str] | None, chunk: int, passes: str = "auto"):
    for name, kind, make, data in cases():
        if only and name not in only:
            continue
        for reentrant in (False, True):
            for clipping in ("flat", "per_layer") if passes == "auto" else ("flat",):
                for c in (None, chunk) if kind.startswith("decoder") else (None,):
                    yield name, kind, make, data, reentrant, clipping, c


def table(path: str) -> str:
    rows = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    counts: dict[str, int] = {}
    for r in rows:
        counts[r["result"]] = counts.get(r["result"], 0) + 1
    lines = [f"{len(rows)} runs: " + ", ".join(f"{k} {v}" for k, v in sorted(counts.items())), "",
             "| model | kind | reentrant | clipping | chunk | result | rel. err | ckpt fwd | cpu s | detail |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        detail = r.get("error", "")[:240] if "error" in r else ("" if r.get("ckpt") else "no recompute seen")
        if r["result"] in ("WRONG", "exact~"):
            detail = f"worst: {r['worst']}"
        if "err_without_checkpointing" in r:
            detail += f"; without checkpointing {r['err_without_checkpointing']:.1e}"
        err = f"{r['err']:.1e}" if "err" in r else ""
        lines.append(f"| {r['model']} | {r['kind']} | {r['reentrant']} | {r['clipping']} | {r['chunk'] or ''} | "
                     f"{r['result']} | {err} | {r.get('ckpt', '')} | {r['cpu_s']} | {detail.replace('|', '/')} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="/tmp/zoo_sweep.jsonl")
    ap.add_argument("--only", default="", help="comma-separated model names")
    ap.add_argument("--chunk", type=int, default=3, help="lm_loss_chunk_size for the causal LMs' chunked runs")
    ap.add_argument("--timeout", type=int, default=240)
    ap.add_argument("--part", default="zoo", choices=["zoo", "lora", "sft"],
                    help="zoo: every zoo model; lora: LoRA with checkpointing enabled on the model (nf4 base + "
                         "prepare_model_for_kbit_training, or by hand); sft: DPSFTTrainer defaults, packing=True")
    ap.add_argument("--passes", default="auto", choices=["auto", "one", "two"],
                    help="flat_clipping_passes of the zoo part (not auto: flat clipping only)")
    ap.add_argument("--table", default="", help="print the table of a results file and exit")
    args = ap.parse_args()
    if args.table:
        print(table(args.table))
        return
    torch.set_num_threads(1)
    only = [s for s in args.only.split(",") if s] or None
    if args.part == "zoo":
        todo = [(functools.partial(run_one, passes=args.passes), job) for job in jobs(only, args.chunk, args.passes)]
    elif args.part == "lora":
        todo = [(run_lora, (name, how, clipping, c)) for name in LORA_DECODERS if not only or name in only
                for how in ("nf4", "manual_reentrant", "manual_nonreentrant") for clipping in ("flat", "per_layer")
                for c in (None, args.chunk)]
    else:
        todo = [(run_sft, (name, clipping, c)) for name in LORA_DECODERS if not only or name in only
                for clipping in ("flat", "per_layer") for c in (None, args.chunk)]
    with open(args.out, "a") as f:
        for fn, job in todo:
            row = fn(*job, timeout=args.timeout)
            f.write(json.dumps(row) + "\n")
            f.flush()
            print(f"{row['model']:>18} reentrant={row['reentrant']!s:5} {row['clipping']:9} chunk={row['chunk']!s:4} "
                  f"{row['result']:8} {row.get('err', float('nan')):.1e} ckpt={row.get('ckpt', '')} {row['cpu_s']}s "
                  f"{row.get('error', '')[:160]} {row.get('err_without_checkpointing', '')}", flush=True)


if __name__ == "__main__":
    main()
