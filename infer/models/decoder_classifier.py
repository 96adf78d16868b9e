"""A decoder served as a sequence classifier (a reranker): the Llama-family body, its last token's state
through a score head of `num_labels` rows, as transformers' Qwen3ForSequenceClassification and vLLM's
as_seq_cls_model compute it.

The score head comes from one of two places:
  - the checkpoint's `score.weight` (a reranker saved as Qwen3ForSequenceClassification);
  - the LM head of a reranker saved as a causal LM, built at load from the rows of the tokens named by
    `classifier_from_token` (vLLM's `--hf-overrides`). Qwen3-Reranker answers "yes" or "no" after its
    prompt, its score being the softmax of those two logits' "yes" share; that is the sigmoid of
    logit_yes - logit_no = (w_yes - w_no) . h, so one row, w_yes - w_no (method from_2_way_softmax),
    scores it without computing the vocabulary's other 151k logits.
With tied embeddings (Qwen3-Reranker-0.6B and -4B) the LM head is the token embedding: its rows come
from `embed_tokens.weight`, which loads as the embedding too.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import torch
from torch import nn

from infer.layers.parallel import SINGLE, TensorParallel
from infer.models.config import ModelConfig
from infer.models.decoder_embedding import DecoderEmbeddingModel

EMBED_TOKENS = "model.embed_tokens.weight"


class DecoderClassifier(DecoderEmbeddingModel):
    def __init__(self, cfg: ModelConfig, tp: TensorParallel = SINGLE):
        super().__init__(cfg, tp)
        self.score = nn.Linear(cfg.hidden_size, cfg.num_labels, bias=False)

    def remap_weight(self, name: str, tensor):
        """Checkpoint name/tensor -> ours, or a list of them: a tied embedding also makes the score."""
        if self.config.classifier_method is None:
            return (name, tensor) if name.startswith("score.") else super().remap_weight(name, tensor)
        if name == "lm_head.weight":
            return None if self.config.tie_word_embeddings else ("score.weight", self._score_rows(tensor))
        remapped = super().remap_weight(name, tensor)
        if remapped is not None and remapped[0] == EMBED_TOKENS and self.config.tie_word_embeddings:
            return [remapped, ("score.weight", self._score_rows(tensor))]
        return remapped

    def _score_rows(self, lm_head):
        """The score head from the LM head's rows of the classifier tokens (reads those rows only)."""
        from infer.models.loader import HeldTensor, LazyTensor  # the loader imports the model files

        rows = torch.stack(
            [lm_head.narrow(0, i, 1).load()[0].float() for i in self.config.classifier_token_ids]
        )
        if self.config.classifier_method == "from_2_way_softmax":
            rows = rows[1:2] - rows[0:1]  # [1, hidden_size]: true - false, in float32 before the cast
        return LazyTensor(HeldTensor(rows))

    def classify(self, hidden: torch.Tensor) -> torch.Tensor:
        """[num_seqs, hidden_size] last-token states -> [num_seqs, num_labels] logits."""
        return self.score(hidden)


def with_classifier_token_ids(cfg: ModelConfig, tokenizer_folder: Path) -> ModelConfig:
    """cfg with the ids of its classifier_from_token, as the tokenizer in `tokenizer_folder` spells them
    (transformers' convert_tokens_to_ids). ValueError for a token the vocabulary lacks."""
    from tokenizers import Tokenizer

    file = tokenizer_folder / "tokenizer.json"
    if not file.is_file():
        raise ValueError(
            f"classifier_from_token needs the model's tokenizer.json; {tokenizer_folder} has none"
        )
    tokenizer = Tokenizer.from_file(str(file))
    ids = []
    for token in cfg.classifier_from_token:
        token_id = tokenizer.token_to_id(token)
        if token_id is None:
            raise ValueError(
                f"classifier_from_token: {token!r} is not a token of {tokenizer_folder}'s vocabulary"
            )
        ids.append(token_id)
    return replace(cfg, classifier_token_ids=tuple(ids))
