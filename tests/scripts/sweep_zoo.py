"""Sweep transformers' model types through the oracle harness of ``tests/clipping/test_zoo.py``
(``helpers.check_exact``; not a test; run by hand).

Each model type of the auto mappings (causal LM, seq2seq LM, sequence / token classification, masked LM, image and
audio classification) is built from its config class with a TINY random-init override (hidden sizes, layers, heads,
vocab, intermediate sizes, positions; dropout off), given a tiny dataset of the right inputs, and run through
``check_exact`` (flat clipping, float64, σ = 0, q = 1: the DP update equals the clipped sum of each example's gradient
of the model's own ``.loss`` on a batch of one). Results are classified:

* ``exact``      the DP step equals the oracle (rtol 1e-7); ``exact~`` only at rtol 1e-4 (float32 computed inside);
* ``refused``    hf_dp raised ``UnsupportedLayerError`` / a ``ValueError`` of its own, with a message;
* ``wrong``      the DP step differs from the oracle (silent: the worst);
* ``crash``      another exception during DP training (not a refusal), or the process died / timed out there;
* ``harness``    building the config, model, inputs or the oracle failed (this script's problem, or the model's).

Usage (from the worktree root)::

    PYTHONPATH=$PWD python tests/scripts/sweep_zoo.py --out /tmp/sweep.jsonl [--only llama,bert] [--all-tasks]
    python tests/scripts/sweep_zoo.py --table /tmp/sweep.jsonl > tests/scripts/SWEEP.md

Models run one at a time in a child process (``nice -n 10``, one thread), with a per-model timeout; a child that dies
is restarted after the model it was running.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
TESTS = HERE.parent
TASKS = [  # (task, mapping) in priority order: a model type's primary task is the first that lists it
    ("causal_lm", "CAUSAL_LM"),
    ("seq2seq", "SEQ_TO_SEQ_CAUSAL_LM"),
    ("speech_seq2seq", "SPEECH_SEQ_2_SEQ"),
    ("image_cls", "IMAGE_CLASSIFICATION"),
    ("audio_cls", "AUDIO_CLASSIFICATION"),
    ("seq_cls", "SEQUENCE_CLASSIFICATION"),
    ("token_cls", "TOKEN_CLASSIFICATION"),
    ("masked_lm", "MASKED_LM"),
]
N = 4
SEQ = 6
H = 16


# --------------------------------------------------------------------------------------------- tiny configs
SCALAR = {
    **{k: H for k in ("hidden_size", "d_model", "n_embd", "embed_dim", "word_embed_proj_dim", "embedding_size",
                      "dim", "n_embed", "d_embed", "projection_dim", "emb_dim")},
    **{k: 8 for k in ("head_dim", "attention_head_dim", "kv_channels", "d_kv", "d_head", "v_head_dim",
                      "kv_lora_rank", "q_lora_rank", "classifier_proj_size", "attention_head_size")},
    **{k: 2 for k in ("num_attention_heads", "n_head", "encoder_attention_heads", "decoder_attention_heads",
                      "num_heads", "n_heads", "num_decoder_attention_heads")},
    **{k: 2 for k in ("num_key_value_heads", "num_kv_heads", "multi_query_group_num")},
    **{k: 1 for k in ("n_group", "topk_group",
                      "n_shared_experts", "num_shared_experts")},
    **{k: 24 for k in ("intermediate_size", "ffn_dim", "d_ff", "encoder_ffn_dim", "decoder_ffn_dim", "n_inner",
                       "hidden_dim", "ffn_hidden_size", "d_inner", "mlp_dim")},
    **{k: 8 for k in ("moe_intermediate_size", "shared_expert_intermediate_size", "expert_intermediate_size")},
    **{k: 2 for k in ("num_hidden_layers", "n_layer", "num_layers", "encoder_layers", "decoder_layers",
                      "num_decoder_layers", "n_layers", "num_encoder_layers", "speech_encoder_layers")},
    **{k: 4 for k in ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")},
    **{k: 2 for k in ("num_experts_per_tok", "moe_topk", "num_selected_experts")},
    **{k: 4 for k in ("qk_rope_head_dim", "qk_nope_head_dim")},
    **{k: 64 for k in ("max_position_embeddings", "n_positions", "max_target_positions", "n_ctx")},
}
VISION = {"image_size": 32, "patch_size": 4, "num_channels": 3}
SMALL_TOKEN = 61  # tests/helpers.VOCAB


def _shrink_list(key: str, value: list):
    if not value or not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        return value
    k = key.lower()
    if k in ("depths", "num_layers", "layers", "depth", "block_repeats") or k.endswith("depths"):
        return [1] * len(value)
    if "head" in k:
        return [2] * len(value)
    if k in ("hidden_sizes", "embed_dims", "dims", "embed_dim", "hidden_dims", "widths", "channels") or (
            "hidden_size" in k or "embed" in k):
        return [H] * len(value)
    if k == "conv_dim":
        return [H] * len(value)
    return value


LAYER_COUNTS = ("num_hidden_layers", "num_layers", "n_layer", "n_layers", "decoder_layers", "encoder_layers")


def _per_layer(key: str, value: list, layers: int):
    """A per-layer list of the default depth, cut to 2 layers (keeping two different entries where there are, so
    hybrid / sliding-window patterns keep both kinds)."""
    first = value[0]
    other = next((v for v in value if v != first), value[1])
    new = [first, other]
    if key in SCALAR and all(isinstance(v, int) for v in new):
        new = [SCALAR[key]] * 2
    return new


def tiny_kwargs(cfg) -> dict:
    """Overrides for the attributes this config has (sub-configs shrunk recursively, as dicts)."""
    d = cfg.to_dict()
    out: dict = {}
    layers = next((d[k] for k in LAYER_COUNTS if isinstance(d.get(k), int)), 0)
    for key, value in d.items():
        if isinstance(value, list) and layers > 2 and len(value) == layers:
            out[key] = _per_layer(key, value, layers)
        elif key == "per_layer_config" and isinstance(value, dict):
            out[key] = {k: v for k, v in value.items() if str(k).isdigit() and int(k) < 2}
    d = {k: v for k, v in d.items() if k not in out}
    sub = getattr(cfg, "sub_configs", {}) or {}
    for key, value in d.items():
        if key in sub and isinstance(value, dict):
            sub_cfg = getattr(cfg, key, None)
            if sub_cfg is not None and hasattr(sub_cfg, "to_dict"):
                out[key] = {**sub_cfg.to_dict(), **tiny_kwargs(sub_cfg)}
            continue
        if isinstance(value, bool) or value is None and key not in SCALAR:
            continue
        if key in SCALAR and (value is None or isinstance(value, int)):
            if value is None and key not in ("head_dim", "num_key_value_heads"):  # None: "as many as the heads"
                continue
            out[key] = SCALAR[key]
        elif "vocab_size" in key and isinstance(value, int) and value > SMALL_TOKEN:
            out[key] = SMALL_TOKEN
        elif key.endswith("_token_id") and isinstance(value, int) and value >= SMALL_TOKEN:
            out[key] = 1
        elif key in VISION and isinstance(value, int):
            out[key] = VISION[key]
        elif key == "image_size" and isinstance(value, (list, tuple)):
            out[key] = [VISION["image_size"]] * len(value)
        elif isinstance(value, float) and ("dropout" in key or "pdrop" in key or "drop_path" in key
                                           or "layerdrop" in key or "jitter" in key):  # random in train mode
            out[key] = 0.0
        elif isinstance(value, list) and value and all(isinstance(v, float) for v in value) and (
                "drop" in key or "pdrop" in key):  # CvT: one drop-path rate per stage
            out[key] = [0.0] * len(value)
        elif isinstance(value, list):
            new = _shrink_list(key, value)
            if new is not value:
                out[key] = new
    if "vocab_size" in d and d["vocab_size"] is None:  # ESM: no default vocabulary
        out["vocab_size"] = SMALL_TOKEN
    # audio front ends
    if "num_mel_bins" in d:
        out["num_mel_bins"] = 16
    if "max_source_positions" in d and isinstance(d["max_source_positions"], int):
        out["max_source_positions"] = 16
    if "num_conv_pos_embeddings" in d:
        out["num_conv_pos_embeddings"] = 16
        out["num_conv_pos_embedding_groups"] = 2
    if "conv_dim" in d and isinstance(d["conv_dim"], list):
        out["conv_dim"] = [H] * len(d["conv_dim"])
    if "tdnn_dim" in d and isinstance(d["tdnn_dim"], list):
        out["tdnn_dim"] = [H] * len(d["tdnn_dim"])
    for key, value in d.items():  # dropout probabilities left None (classifier_dropout: the heads then use 0.1)
        if value is None and ("dropout" in key or "pdrop" in key):
            out[key] = 0.0
    for key in ("mask_time_prob", "mask_feature_prob"):
        if key in d:
            out[key] = 0.0
    if "qk_rope_head_dim" in d:  # DeepSeek-style attention: head_dim is the rope part
        out["head_dim"] = SCALAR["qk_rope_head_dim"]
    if "rotary_dim" in d and isinstance(d["rotary_dim"], int):
        out["rotary_dim"] = 4
    if "window_size" in d and isinstance(d["window_size"], int):
        out["window_size"] = 2
    if "entity_vocab_size" in d:
        out["entity_vocab_size"] = SMALL_TOKEN
    if "max_length" in d and "num_mel_bins" in d:  # AST: (frames, mel) spectrograms
        out["max_length"] = 32
    out["num_labels"] = 3
    out["classifier_dropout"] = 0.0  # GPT-2 / Llama token-classification heads default to 0.1 without it
    return out


TASK_OVERRIDES: dict[tuple[str, str], dict] = {
    ("reformer", "causal_lm"): dict(is_decoder=True),  # ReformerModelWithLMHead asserts it; the masked LM the converse
    ("perceiver", "masked_lm"): dict(max_position_embeddings=SEQ),  # its decoder queries every position
}


def build(model_type: str, task: str):
    import torch
    from transformers import CONFIG_MAPPING
    from transformers.models.auto import modeling_auto as auto

    mapping = dict(TASKS)[task]
    cls_name = getattr(auto, f"MODEL_FOR_{mapping}_MAPPING_NAMES")[model_type]
    cls_name = cls_name if isinstance(cls_name, str) else cls_name[0]
    import transformers

    model_cls = getattr(transformers, cls_name)
    cfg_cls = CONFIG_MAPPING[model_type]
    own = getattr(model_cls, "config_class", None)  # Llama 4 / Emu3 causal LMs take the text sub-config
    if isinstance(own, type) and issubclass(own, transformers.PreTrainedConfig) and own is not cfg_cls:
        cfg_cls = own
    cfg = cfg_cls()
    kw = tiny_kwargs(cfg)
    if task == "seq2seq" or getattr(cfg, "is_encoder_decoder", False):
        # real checkpoints' configs carry these; some config classes default them to None
        for key, value in (("decoder_start_token_id", 0), ("pad_token_id", 0), ("eos_token_id", 1)):
            if getattr(cfg, key, None) is None:
                kw[key] = value
    if task in ("seq_cls", "token_cls", "masked_lm") and getattr(cfg, "pad_token_id", None) is None:
        kw["pad_token_id"] = 0  # decoders' sequence classification finds the last token by the pad id
        if isinstance(kw.get("text_config"), dict):
            kw["text_config"]["pad_token_id"] = 0
    kw.update(OVERRIDES.get(model_type, {}))
    kw.update(TASK_OVERRIDES.get((model_type, task), {}))
    try:
        cfg = cfg_cls(**kw, experts_implementation="eager")
    except TypeError:
        cfg = cfg_cls(**kw)
    torch.manual_seed(0)
    torch.set_default_dtype(torch.float64)
    model = model_cls(cfg)
    languages = getattr(cfg, "languages", None)
    if hasattr(model, "set_default_language") and languages:  # X-MOD: one adapter per language
        model.set_default_language(languages[0])
    return model, cls_name


MAMBA2 = dict(num_heads=4, head_dim=8, expand=2, n_groups=1, state_size=8, conv_kernel=4, chunk_size=8)
OVERRIDES: dict[str, dict] = {  # where the generic shrink breaks a config's own constraints
    "codegen": dict(n_head=4),
    "perceiver": dict(d_latents=16, num_latents=4, num_self_attends_per_block=1, num_self_attention_heads=2,
                      num_cross_attention_heads=1, d_model=16),
    "deepseek_v2": dict(num_experts_per_tok=2),
    "mamba2": MAMBA2,
    "bamba": dict(mamba_n_heads=4, mamba_d_head=8, mamba_expand=2, mamba_n_groups=1, mamba_d_state=8,
                  mamba_chunk_size=8),
    # DbrxAttention reads attn_config.rope_theta, and clamps with clip_qkv (None fails)
    "dbrx": dict(attn_config=dict(kv_n_heads=1, attn_pdrop=0.0, rope_theta=10000.0, clip_qkv=8.0)),
    "zamba": dict(num_hidden_layers=3, layers_block_type=["mamba", "hybrid", "hybrid"]),  # shared block: 2 users
    "reformer": dict(axial_pos_embds_dim=[8, 8], axial_pos_shape=[2, 3], attn_layers=["local", "lsh"],
                     local_attn_chunk_length=2, lsh_attn_chunk_length=2, num_buckets=2, num_hashes=1, hash_seed=0,
                     hidden_size=16, feed_forward_size=24, max_position_embeddings=6),
    "gemma3n_text": dict(num_kv_shared_layers=0),  # the default (15) shares more layers than the 2 kept
    "longformer": dict(attention_window=4), "led": dict(attention_window=4),  # windows of 512 on 6 tokens: NaN rows
    "layoutlmv3": dict(coordinate_size=2, shape_size=4, visual_embed=False),  # 4 * 2 + 2 * 4 = hidden 16; text only
    "mobilevitv2": dict(patch_size=2),  # 2x2 maps at the last stage
    "efficientnet": dict(width_coefficient=0.25, depth_coefficient=0.25, hidden_dim=320),  # 320 = 1280 * 0.25
    "moonshine_streaming": dict(num_key_value_heads=2),  # its decoder reads it; the config class has no default
    "bit": dict(num_groups=4),  # GroupNorm(32) on 16 channels
    "cvt": dict(depth=[1, 2, 3]),  # CvtStage indexes its drop-path rates by the stage: depth[i] > i
    "lilt": dict(hidden_size=24),  # the layout branch: hidden / 6 per box coordinate and hidden / 4 wide
    "hgnet_v2": dict(stem_channels=[3, 8, 16], stage_in_channels=[16, 16, 16, 16], stage_mid_channels=[8, 8, 8, 8],
                     stage_out_channels=[16, 16, 16, 16], stage_numb_of_layers=[2, 2, 2, 2]),
    "musicgen": dict(num_codebooks=1), "musicgen_melody": dict(num_codebooks=1),  # input_ids (B * codebooks, T)
    "granitemoehybrid": dict(mamba_n_heads=4, mamba_d_head=8, mamba_expand=2, mamba_n_groups=1, mamba_d_state=8,
                             mamba_chunk_size=8),
}


def lora(model, task: str):
    """LoRA (r = 2, random B so the adapter's gradients are not trivially zero) on every linear layer but the head:
    the way forward most refusals name."""
    from peft import LoraConfig, get_peft_model

    kind = {"causal_lm": "CAUSAL_LM", "seq2seq": "SEQ_2_SEQ_LM", "speech_seq2seq": "SEQ_2_SEQ_LM", "seq_cls": "SEQ_CLS",
            "token_cls": "TOKEN_CLS"}.get(task)
    cfg = LoraConfig(r=2, lora_alpha=4, target_modules="all-linear", init_lora_weights=False, task_type=kind)
    return get_peft_model(model, cfg)


# ------------------------------------------------------------------------------------------------ tiny data
def make_data(model, task: str):
    import torch
    from helpers import VOCAB, cls_dataset, lm_dataset, seq2seq_dataset, token_dataset

    cfg = model.config
    if task == "causal_lm":
        data = lm_dataset(N, seq_len=SEQ)
        if getattr(cfg, "num_codebooks", None) == 1:  # MusicGen: labels (T, codebooks)
            data = data.map(lambda row: {"labels": [[t] for t in row["labels"]]})
        vision = getattr(cfg, "vision_config", None)
        if vision is not None and "pixel_values" in inspect.signature(model.forward).parameters:  # GIT: captions
            g = torch.Generator().manual_seed(0)
            size = vision.image_size
            x = torch.randn(N, vision.num_channels, size, size, generator=g, dtype=torch.float64)
            data = [{**{k: torch.tensor(v) for k, v in data[i].items()}, "pixel_values": x[i]} for i in range(N)]
        return data
    if task == "seq2seq":
        return seq2seq_dataset(N)
    if task == "speech_seq2seq":  # audio inputs as for audio classification, token labels as for seq2seq
        audio = make_data(model, "audio_cls")
        labels = seq2seq_dataset(N)["labels"]
        return [{**{k: v for k, v in a.items() if k != "labels"}, "labels": torch.tensor(t)}
                for a, t in zip(audio, labels)]
    if task == "seq_cls":
        data = cls_dataset(N, num_labels=3, seq_len=SEQ)
        eos = getattr(cfg, "eos_token_id", None)
        if getattr(cfg, "is_encoder_decoder", False) and isinstance(eos, int):  # BART-style heads pool the <eos>
            def end_with_eos(row):
                n = sum(row["attention_mask"])
                return {"input_ids": row["input_ids"][:n - 1] + [eos] + row["input_ids"][n:]}
            data = data.map(end_with_eos)
        return data
    if task == "token_cls":
        return token_dataset(N, num_labels=3, seq_len=SEQ)
    if task == "masked_lm":
        return token_dataset(N, num_labels=VOCAB, seq_len=SEQ)
    g = torch.Generator().manual_seed(0)
    y = torch.randint(0, 3, (N,), generator=g)
    if task == "image_cls" and model.main_input_name == "input_ids":  # ImageGPT: pixels as colour-cluster tokens
        return cls_dataset(N, num_labels=3, seq_len=SEQ)
    if task == "image_cls":
        vision = getattr(cfg, "vision_config", None) or cfg  # CLIP / SigLIP classifiers: the vision sub-config
        size = getattr(vision, "image_size", 64)  # CNNs without one: big enough to keep 2x2 maps at the end
        size = size if isinstance(size, (list, tuple)) else (size, size)
        if any(isinstance(m, torch.nn.modules.batchnorm._BatchNorm) for m in model.modules()):
            size = tuple(max(s, 64) for s in size)  # a batch-of-one BatchNorm needs maps larger than 1x1 at the end
        ch = getattr(vision, "num_channels", 3)
        x = torch.randn(N, ch, *size, generator=g, dtype=torch.float64)
        return [{"pixel_values": x[i], "labels": y[i]} for i in range(N)]
    if task == "audio_cls":
        name = model.main_input_name
        if name == "inputs" and hasattr(model, "encoder"):  # SpeechEncoderDecoderModel: its encoder's input
            name, cfg = model.encoder.main_input_name, model.encoder.config
        if hasattr(cfg, "max_length") and hasattr(cfg, "num_mel_bins"):  # AST: (frames, mel) as input_values
            x = torch.randn(N, cfg.max_length, cfg.num_mel_bins, generator=g, dtype=torch.float64)
        elif name == "input_features" and hasattr(cfg, "feature_projection_input_dim"):  # W2V-BERT, Seamless
            x = torch.randn(N, 32, cfg.feature_projection_input_dim, generator=g, dtype=torch.float64)
        elif name == "input_features" and hasattr(cfg, "input_feat_per_channel"):  # Speech2Text
            x = torch.randn(N, 32, cfg.input_feat_per_channel * cfg.input_channels, generator=g, dtype=torch.float64)
        elif name == "input_features" and hasattr(cfg, "feature_size") and not hasattr(cfg, "max_source_positions"):
            x = torch.randn(N, 32, cfg.feature_size, generator=g, dtype=torch.float64)
        elif name == "input_values":
            x = torch.randn(N, 1600, generator=g, dtype=torch.float64)
        elif name == "input_features":
            mel = getattr(cfg, "num_mel_bins", 16)
            if hasattr(cfg, "max_source_positions"):  # Whisper: (mel, 2 * positions)
                x = torch.randn(N, mel, 2 * cfg.max_source_positions, generator=g, dtype=torch.float64)
            elif hasattr(cfg, "max_length"):  # AST: (frames, mel)
                x = torch.randn(N, cfg.max_length, mel, generator=g, dtype=torch.float64)
            else:
                x = torch.randn(N, 32, mel, generator=g, dtype=torch.float64)
        else:
            raise RuntimeError(f"harness: audio input {name!r}")
        return [{name: x[i], "labels": y[i]} for i in range(N)]
    raise RuntimeError(task)


# ----------------------------------------------------------------------------------------------- one model
class Timeout(Exception):
    pass


def _where(tb_exc: BaseException) -> tuple[str, str]:
    frames = traceback.extract_tb(tb_exc.__traceback__)
    last = frames[-1] if frames else None
    ours = [f for f in frames if "/hf_dp/" in f.filename]

    def fmt(f):
        return f"{f.filename.split('/site-packages/')[-1].split('/wt/')[-1]}:{f.lineno} {f.name}"

    return (fmt(last) if last else "?"), (fmt(ours[-1]) if ours else "")


def _oracle_not_finite(model_type: str, task: str) -> bool:
    """Whether some example's own gradient (the oracle's, on a fresh model) has a NaN / inf entry (Longformer's
    token / masked-LM heads on a padded example: its fully masked sliding-window rows)."""
    import torch
    from helpers import per_example_grads

    torch.set_default_dtype(torch.float64)
    torch.manual_seed(0)
    model, _ = build(model_type, task)
    if os.environ.get("SWEEP_PEFT") == "lora":
        model = lora(model, task)
    model = model.double()
    grads = per_example_grads(model, make_data(model, task))
    return not all(bool(torch.isfinite(t).all()) for g in grads for t in g.values())


def run_one(model_type: str, task: str) -> dict:
    import warnings

    import torch
    from helpers import check_exact

    # SWEEP_SELF_CHECK=0: the always-on checks alone (dp_self_check=False)
    self_check = {"dp_self_check": False} if os.environ.get("SWEEP_SELF_CHECK") == "0" else {}
    warnings.simplefilter("ignore")
    rec = {"model_type": model_type, "task": task}
    t0 = time.time()
    phase = "build"
    try:
        model, cls_name = build(model_type, task)
        rec["class"] = cls_name
        rec["params"] = sum(p.numel() for p in model.parameters())
        if os.environ.get("SWEEP_PEFT") == "lora":
            model = lora(model, task)
        phase = "data"
        data = make_data(model, task)
        phase = "dp"
        for rtol, label in ((1e-7, "exact"), (1e-4, "exact~")):
            try:
                with tempfile.TemporaryDirectory() as tmp:
                    check_exact(model, data, tmp, clipping=os.environ.get("SWEEP_CLIPPING", "flat"), rtol=rtol,
                                **self_check)
                rec["status"] = label
                break
            except AssertionError as e:
                if any("/hf_dp/" in f.filename for f in traceback.extract_tb(e.__traceback__)):
                    raise  # the model's own assert (Reformer's backward in eval mode), not the comparison
                rec["status"] = "wrong"
                if _oracle_not_finite(model_type, task):
                    raise RuntimeError("the model's own gradient on one example (batch of one) is not finite: "
                                       "nothing to compare (hf_dp gives such an example clipping factor 0)") from e
                msg = str(e)
                rec["message"] = " ".join(msg.split())[:600]
                if rtol == 1e-4:
                    break
                torch.set_default_dtype(torch.float64)
                torch.manual_seed(0)
                model, _ = build(model_type, task)
                if os.environ.get("SWEEP_PEFT") == "lora":
                    model = lora(model, task)
                data = make_data(model, task)
    except Timeout:
        rec["status"] = "crash" if phase == "dp" else "harness"
        rec["message"] = f"timeout in {phase}"
    except BaseException as e:  # noqa: BLE001
        last, ours = _where(e)
        from hf_dp import UnsupportedLayerError

        msg = " ".join(f"{type(e).__name__}: {e}".split())[:900]
        rec["message"], rec["where"], rec["hf_dp_frame"] = msg, last, ours
        rec["phase"] = phase
        if "per_sample_max_grad_norm must be a finite number" in str(e) or "is not finite: nothing to" in str(e):
            phase = "oracle"  # the model's own gradient on one example is not finite: nothing to compare
        if phase != "dp":
            rec["status"] = "harness"
            if isinstance(e, (ImportError, ModuleNotFoundError)) or "requires the" in str(e) or "pip install" in str(e):
                rec["status"] = "skipped"
        elif isinstance(e, UnsupportedLayerError) or (isinstance(e, ValueError) and "/hf_dp/" in last):
            rec["status"] = "refused"
        elif ("per_example_grads" in "".join(traceback.format_tb(e.__traceback__))
              and "/hf_dp/" not in "".join(traceback.format_tb(e.__traceback__))):
            rec["status"] = "harness"  # the oracle (the model's own loss) failed
        else:
            rec["status"] = "crash"
            rec["trace"] = "".join(traceback.format_exception(e))[-3000:]
    rec["seconds"] = round(time.time() - t0, 1)
    return rec


def child(jobs: list[list[str]], out: str, progress: str, timeout: int) -> None:
    import torch

    torch.set_num_threads(1)
    sys.path.insert(0, str(TESTS))
    import logging

    import transformers

    transformers.logging.set_verbosity_error()
    logging.getLogger("hf_dp").setLevel(logging.ERROR)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    def alarm(*_):
        raise Timeout()

    signal.signal(signal.SIGALRM, alarm)
    for model_type, task in jobs:
        Path(progress).write_text(json.dumps([model_type, task, time.time()]))
        signal.alarm(timeout)
        try:
            rec = run_one(model_type, task)
        finally:
            signal.alarm(0)
        torch.set_default_dtype(torch.float32)
        with open(out, "a") as f:
            f.write(json.dumps(rec) + "\n")
        print(f"{rec['status']:8} {model_type:28} {task:10} {rec.get('seconds')}s {rec.get('message', '')[:150]}",
              file=sys.stderr, flush=True)


# ------------------------------------------------------------------------------------------------- parent
def all_jobs(all_tasks: bool, only: list[str] | None, task_filter: list[str] | None = None) -> list[list[str]]:
    from transformers.models.auto import modeling_auto as auto

    seen: dict[str, list[str]] = {}
    for task, mapping in TASKS:
        for mt in getattr(auto, f"MODEL_FOR_{mapping}_MAPPING_NAMES"):
            seen.setdefault(mt, []).append(task)
    jobs = []
    for mt, tasks in seen.items():
        if only and mt not in only:
            continue
        # primary task: seq2seq LM for encoder-decoders, sequence classification for encoders (they also have
        # LM heads), else the first mapping listing the type
        if "seq2seq" in tasks or "speech_seq2seq" in tasks:
            primary = "seq2seq" if "seq2seq" in tasks else "speech_seq2seq"
        elif "masked_lm" in tasks and "seq_cls" in tasks:
            primary = "seq_cls"
        else:
            primary = tasks[0]
        for t in (sorted(tasks, key=lambda t: t != primary) if all_tasks else [primary]):
            if not task_filter or t in task_filter:
                jobs.append([mt, t])
    order = {t: i for i, (t, _) in enumerate(TASKS)}
    return sorted(jobs, key=lambda j: (order[j[1]], j[0]))


def done_jobs(out: str) -> set[tuple[str, str]]:
    if not os.path.exists(out):
        return set()
    return {(r["model_type"], r["task"]) for r in map(json.loads, open(out).read().splitlines()) if r}


def parent(args) -> None:
    jobs = all_jobs(args.all_tasks, args.only.split(",") if args.only else None,
                    args.tasks.split(",") if args.tasks else None)
    if args.peft:
        os.environ["SWEEP_PEFT"] = args.peft
    if args.clipping:  # inherited by the child processes
        os.environ["SWEEP_CLIPPING"] = args.clipping
    if args.no_self_check:
        os.environ["SWEEP_SELF_CHECK"] = "0"
    if args.redo_exact:  # the pairs of an earlier run that were exact (e.g. to re-run them per layer)
        latest = {(r["model_type"], r["task"]): r for r in map(json.loads, open(args.redo_exact).read().splitlines())}
        jobs = [list(k) for k, r in latest.items() if r["status"] in ("exact", "exact~")]
    if args.redo:  # the (model type, task) pairs of an earlier run that were not exact
        latest = {(r["model_type"], r["task"]): r for r in map(json.loads, open(args.redo).read().splitlines())}
        jobs = [list(k) for k, r in latest.items() if r["status"] not in ("exact", "skipped")]
    if args.skip:
        jobs = [j for j in jobs if j[0] not in args.skip.split(",")]
    deadline = time.time() + args.budget * 60
    while True:
        pending = [j for j in jobs if tuple(j) not in done_jobs(args.out)]
        if not pending or time.time() > deadline:
            break
        with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
            json.dump(pending, f)
            jobs_file = f.name
        progress = jobs_file + ".progress"
        cmd = ["nice", "-n", "10", sys.executable, __file__, "--child", jobs_file, "--out", args.out,
               "--progress", progress, "--timeout", str(args.timeout)]
        proc = subprocess.Popen(cmd, start_new_session=True, stdout=subprocess.DEVNULL)
        while proc.poll() is None:
            time.sleep(1)
            try:
                mt, task, started = json.loads(Path(progress).read_text())
            except (OSError, ValueError):
                continue
            if time.time() - started > args.timeout + 30 or time.time() > deadline:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                break
        if proc.returncode != 0:
            try:
                mt, task, started = json.loads(Path(progress).read_text())
            except (OSError, ValueError):
                break
            if (mt, task) not in done_jobs(args.out):
                rec = {"model_type": mt, "task": task, "status": "crash",
                       "message": f"process died or hung (rc {proc.returncode})",
                       "seconds": round(time.time() - started, 1)}
                with open(args.out, "a") as f:
                    f.write(json.dumps(rec) + "\n")
                print(f"crash    {mt:28} {task:10} {rec['message']}", flush=True)


def table(path: str) -> str:
    recs = {}
    for line in open(path).read().splitlines():
        r = json.loads(line)
        recs[(r["model_type"], r["task"])] = r
    order = ["wrong", "crash", "refused", "exact~", "exact", "harness", "skipped"]
    counts = {s: sum(r["status"] == s for r in recs.values()) for s in order}
    lines = ["# Sweep of transformers model types through the oracle harness (tests/scripts/sweep_zoo.py)", "",
             "Tiny random-init configs, float64, flat clipping, σ = 0, q = 1, 4 examples; the oracle is each example's "
             "gradient of the model's own `.loss` on a batch of one (`tests/helpers/runs.py: check_exact`). `exact~`: "
             "exact at rtol 1e-4 only (float32 computed inside). `harness`: the tiny config, the inputs or the "
             "model's own loss failed before hf_dp ran (not an hf_dp finding).", "",
             "Counts: " + ", ".join(f"{s} {c}" for s, c in counts.items() if c), "",
             "| model type | task | class | result | message / where |", "| --- | --- | --- | --- | --- |"]
    for r in sorted(recs.values(), key=lambda r: (order.index(r["status"]), r["task"], r["model_type"])):
        msg = r.get("message", "").replace("|", "\\|")[:400]
        where = r.get("hf_dp_frame") or ""
        if r["status"] == "crash" and r.get("where"):
            where = f"{where} → {r['where']}" if where else r["where"]
        cell = msg + (f" ({where})" if where and r["status"] in ("crash", "refused", "harness") else "")
        lines.append(f"| {r['model_type']} | {r['task']} | {r.get('class', '')} | {r['status']} | {cell} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="/tmp/sweep.jsonl")
    ap.add_argument("--only")
    ap.add_argument("--skip")
    ap.add_argument("--redo", help="a results file: re-run its pairs that were not exact")
    ap.add_argument("--redo-exact", help="a results file: re-run its pairs that were exact")
    ap.add_argument("--clipping", help="flat (default) or per_layer")
    ap.add_argument("--peft", help="lora: train LoRA adapters on every linear layer instead of the full model")
    ap.add_argument("--no-self-check", action="store_true", help="dp_self_check=False (the always-on checks alone)")
    ap.add_argument("--tasks", help="only these tasks (comma-separated)")
    ap.add_argument("--all-tasks", action="store_true")
    ap.add_argument("--timeout", type=int, default=90)
    ap.add_argument("--budget", type=float, default=60, help="minutes")
    ap.add_argument("--child")
    ap.add_argument("--progress")
    ap.add_argument("--table")
    args = ap.parse_args()
    if args.table:
        print(table(args.table), end="")
    elif args.child:
        child(json.loads(Path(args.child).read_text()), args.out, args.progress, args.timeout)
    else:
        parent(args)


if __name__ == "__main__":
    main()
