"""The one shared testing module: the oracle, tiny models and data, argument builders and the exactness checks.

Test modules import from here and never from each other (``tests/architecture/test_test_layout.py``).

* ``helpers.oracle``: each example's gradient of the model's own loss on a batch of ONE, float64, clipped by the
  rule written out here and summed. It never imports hf_dp.
* ``helpers.models``, ``helpers.data``: tiny random-init models (no Hub download), small datasets, paths, the
  example scripts loaded as modules.
* ``helpers.runs``: argument builders (``dp_args`` for one exact step, ``quick_dp_args`` for a short noisy run) and
  the exactness checks (``check_update``, ``check_exact``, ``run_group_step``, ``check_engine``) that run hf_dp and
  compare with the oracle.
* ``helpers.neighbours``: the neighbouring-datasets harness (‖Σ_D − Σ_D′‖ ≤ C with σ = 0, q = 1).
* ``helpers.chat``: the trl trainers' tokenizer, chat data and the DP-SFT oracle step (trl imported lazily).
"""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from .chat import (  # noqa: E402
    chat_tokenizer,
    make_sft_trainer,
    sft_args,
    sft_dataset,
    sft_distributed_dataset,
    sft_dp_update,
    sft_row_grads,
    turns,
)
from .data import (  # noqa: E402
    AUTHORS,
    EXAMPLES,
    REPO,
    SCRIPTS,
    Rows,
    cls_dataset,
    decoder_data,
    image_cls,
    lm_dataset,
    load_example,
    seq2seq_dataset,
    token_dataset,
    toy_rows,
    user_data,
)
from .models import (  # noqa: E402
    VOCAB,
    CheckpointedBlocks,
    FallbackGate,
    LossOut,
    Out,
    ReadsChildWeight,
    Seq,
    Toy,
    lora_llama,
    p_tuning,
    t5_frozen_bias,
    tiny_bert,
    tiny_bert_mlm,
    tiny_bert_token_classification,
    tiny_gpt2,
    tiny_llama,
    tiny_roberta,
    tiny_t5,
    toy_loss,
)
from .oracle import (  # noqa: E402
    automatic_clipped_sum,
    example_norms,
    flat_clipped_sum,
    group_clipped_sum,
    loop_grads,
    loss_keeps_float64,
    per_example_grads,
    single_example_loss,
    sorted_norms,
    trainer_loss,
    user_gradients,
)
from .runs import (  # noqa: E402
    ATOL,
    RTOL,
    adam_args,
    assert_refused_before_any_release,
    assert_updates_close,
    check_engine,
    check_exact,
    check_update,
    close_distributed,
    dp_args,
    free_port,
    group_norms,
    one_step_against_oracle,
    quick_dp_args,
    run_group_step,
    sampled_indices,
    sampled_users,
    train_toy,
    user_args,
)

__all__ = [
    "ATOL", "AUTHORS", "EXAMPLES", "REPO", "RTOL", "SCRIPTS", "VOCAB", "Rows", "Seq", "adam_args",
    "assert_refused_before_any_release", "assert_updates_close", "chat_tokenizer", "check_engine", "check_exact",
    "check_update", "close_distributed", "cls_dataset", "decoder_data", "dp_args", "example_norms",
    "flat_clipped_sum", "free_port", "group_clipped_sum", "one_step_against_oracle", "group_norms", "image_cls",
    "lm_dataset", "load_example", "loop_grads", "loss_keeps_float64", "make_sft_trainer", "per_example_grads",
    "quick_dp_args", "run_group_step", "sampled_indices", "seq2seq_dataset", "sft_args", "sft_dataset",
    "sft_distributed_dataset", "sft_dp_update", "sft_row_grads", "single_example_loss", "sorted_norms", "tiny_bert",
    "tiny_bert_mlm", "tiny_bert_token_classification", "tiny_gpt2", "tiny_llama", "tiny_roberta", "tiny_t5",
    "token_dataset", "turns", "user_args", "user_data", "CheckpointedBlocks", "FallbackGate", "LossOut", "Out", "Toy",
    "ReadsChildWeight",
    "p_tuning", "t5_frozen_bias", "toy_loss", "toy_rows", "train_toy", "lora_llama", "user_gradients",
    "sampled_users", "automatic_clipped_sum", "trainer_loss",
]
