"""DPO preference rows for the trl trainers' tests (``tests/trl_trainers/test_dpo.py``) and the two-process worker
(``tests/scripts/dpo_worker.py``); trl and hf_dp's DPO trainer are imported when a function runs."""

from __future__ import annotations

import warnings

from datasets import Dataset

from .chat import chat_tokenizer

ROWS = [("hello how are you", " fine thanks", " a dog ran"),
        ("what is your name", " my name is bot", " the cat"),
        ("hi", " good day", " the cat sat on a mat"),
        ("a dog ran", " on the mat", " hello"),
        ("how are you", " good thanks", " what"),
        ("the cat", " sat on the mat", " ran")]


def pairs(n: int = 4, users: list[str] | None = None) -> Dataset:
    rows = [{"prompt": p, "chosen": c, "rejected": r} for p, c, r in ROWS[:n]]
    if users is not None:
        for row, user in zip(rows, users):
            row["user"] = user
    return Dataset.from_list(rows)


def dpo_args(tmp_path, per_device: int = 2, ga: int = 2, **kw):
    """``DPDPOConfig`` for one exact step. Flat clipping is book-keeping (``flat_clipping_passes="one"``) unless
    ``kw`` says otherwise: trl's checkpointing is on, under which "auto" takes two passes, whose backward rounds in the
    float32 of Llama's RMSNorm (tests/clipping/test_two_pass.py tests DPO rows in two passes)."""
    from hf_dp import DPDPOConfig

    if kw.get("clipping", "flat") == "flat":
        kw.setdefault("flat_clipping_passes", "one")

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return DPDPOConfig(**{
            "output_dir": str(tmp_path), "noise_multiplier": 0.0, "per_sample_max_grad_norm": 1.0,
            "per_device_train_batch_size": per_device, "gradient_accumulation_steps": ga, "max_steps": 1,
            "learning_rate": 1.0, "optim": "sgd", "lr_scheduler_type": "constant", "weight_decay": 0.0,
            "use_cpu": True, "report_to": "none", "save_strategy": "no", "dp_seed": 0, "disable_tqdm": True,
            "logging_strategy": "no", "max_length": 64, "beta": 0.5, **kw,
        })


def make_dpo_trainer(model, data, args, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from hf_dp import DPDPOTrainer

        return DPDPOTrainer(model=model, args=args, train_dataset=data, processing_class=chat_tokenizer(), **kw)


def distributed_pairs() -> Dataset:
    """8 rows: per_device 2 × GA 2 × 2 processes = N, so q = 1."""
    extra = [("good day", " the dog sat on the mat", " hi"), ("what ran", " a cat ran", " my name is bot")]
    return Dataset.from_list([{"prompt": p, "chosen": c, "rejected": r} for p, c, r in ROWS + extra])


def padding_dependent(model) -> None:
    """The model's logits (a DPO policy's, a reward model's scores) scaled by the batch's padded length: a row's loss
    depends on the other rows of its batch, which the counterfactual check must refuse."""
    forward = model.forward

    def leaky(*args, **kwargs):
        out = forward(*args, **kwargs)
        out.logits = out.logits * (1 + 0.05 * kwargs["input_ids"].shape[1])
        return out

    model.forward = leaky


# ---------------------------------------------------------------------- the DPO oracle (trl's own loss, one row)
def dpo_float64_head(model) -> None:
    """Replace trl's fused log-prob head (float32 tiles) in ``model`` by the same per-token quantities computed in
    float64 from the model's own logits with plain torch ops."""
    import types

    import torch

    forward = type(model).forward

    def fused(self, *args, fused_lm_head=False, labels=None, **kwargs):
        out = forward(self, *args, **kwargs)
        if not fused_lm_head:
            return out
        logp = out.logits[:, :-1].log_softmax(-1)
        target = labels[:, 1:]
        mask = target != -100
        log_probs = logp.gather(-1, target.clamp(min=0)[..., None])[..., 0].masked_fill(~mask, 0)
        zeros = torch.zeros_like(log_probs)
        return types.SimpleNamespace(log_probs=log_probs, entropy=zeros, mean_logits=zeros, is_top1=mask & False,
                                     log_sum_sq_probs=torch.logsumexp(2 * logp, -1).masked_fill(~mask, 0).detach(),
                                     loss=None, aux_loss=None)

    model.forward = types.MethodType(fused, model)


def dpo_trl_oracle(model, data, dp_config, tmp_path, exact_head: bool = True, **kw):
    """A plain trl DPOTrainer with the DP run's DPO settings (``dp_config``), on ``model`` (a copy of the DP run's
    initial model)."""
    from trl import DPOConfig, DPOTrainer

    keep = ("beta", "loss_type", "loss_weights", "ld_alpha", "f_divergence_type", "f_alpha_divergence_coef",
            "label_smoothing", "use_weighting", "max_length", "precompute_ref_log_probs", "truncation_mode", "seed",
            "discopop_tau")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        config = DPOConfig(output_dir=str(tmp_path / "oracle"), use_cpu=True, report_to="none", bf16=False,
                           gradient_checkpointing=False, **{k: getattr(dp_config, k) for k in keep})
        trainer = DPOTrainer(model=model, args=config, train_dataset=data, processing_class=chat_tokenizer(), **kw)
    if exact_head:
        dpo_float64_head(trainer.model.get_base_model() if hasattr(trainer.model, "get_base_model") else trainer.model)
        if trainer.ref_model is not None:
            dpo_float64_head(trainer.ref_model)
    return trainer


def dpo_row_grads(oracle, indices: list[int]) -> list[dict]:
    """Each row's gradient of trl's own loss on a batch of that row alone."""
    import torch

    model = oracle.model
    model.train()
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    out = []
    for i in indices:
        model.zero_grad(set_to_none=True)
        oracle.compute_loss(model, oracle.data_collator([oracle.train_dataset[i]])).backward()
        out.append({n: p.grad.clone() if p.grad is not None else torch.zeros_like(p) for n, p in params.items()})
    model.zero_grad(set_to_none=True)
    return out
