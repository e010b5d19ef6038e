"""lm-evaluation-harness's `LM` over dtrain's model: loglikelihood, loglikelihood_rolling and generate_until.

The model is the one training builds (one process, or FSDP2/HSDP/DDP over the default process group), called as
`model(tokens) -> logits`, and the tokenizer is the run's. What the harness's `hf` backend does is done the same way
here, with the harness's own helpers (`Collator` batching longest first, right-padded log-likelihood batches with
one-token continuations of one context scored once, `get_rolling_token_windows`, its generation-kwarg and
stop-sequence functions), so that the numbers are the same for the same weights.

Every rank is given all requests and answers its share (share.py), in lockstep under a sharded model
(lockstep.py); the answers are gathered, so each method returns one answer per request, in order, on every rank.
Generation runs dtrain's own KV-cache decoding (dtrain.models.decoding.generate) over rows of equal context
length, so a row never sees padding. Tokens and sharding as a user sees them: docs/evaluation.md, "How it runs".
"""

from __future__ import annotations

import itertools
from typing import Any

import torch
import torch.nn.functional as F
from lm_eval.api.model import TemplateLM
from lm_eval.models.utils import (
    Collator,
    handle_stop_sequences,
    normalize_gen_kwargs,
    postprocess_generated_text,
)
from lm_eval.models.utils_hf import pad_and_concat
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
from torch import nn

from dtrain.data import Tokenizer
from dtrain.errors import ConfigError
from dtrain.eval.lockstep import Lockstep, LockstepModel, full_logits
from dtrain.eval.share import Share
from dtrain.models.decoding import Sampling, generate

# The harness's hf backend's default, so that a task without max_gen_toks generates as much here.
DEFAULT_MAX_GEN_TOKS = 256


class DtrainLM(TemplateLM):
    """`model` (tokens -> logits, already on `device`) with the run's `tokenizer`; `eos_ids` end a generation,
    `max_length` is the model's context (longer inputs are cut from the left, as in the hf backend)."""

    def __init__(
        self,
        model: nn.Module,
        tokenizer: Tokenizer,
        max_length: int,
        device: torch.device,
        eos_ids: tuple[int, ...] = (),
        batch_size: int = 1,
        max_gen_toks: int = DEFAULT_MAX_GEN_TOKS,
        seed: int = 0,
    ) -> None:
        super().__init__()
        self.model, self.run_tokenizer, self.max_length = model, tokenizer, max_length
        self._device = device
        self.eos_ids = eos_ids or (tokenizer.eos_id,)
        self.batch_size, self.max_gen_toks, self.seed = batch_size, max_gen_toks, seed
        self.share = Share.of_world()
        self.lockstep = Lockstep(model, torch.tensor([[tokenizer.bos_id]], device=device))

    # -- what the harness asks of a TemplateLM --------------------------------------------------------------------
    @property
    def eot_token_id(self) -> int:
        return self.run_tokenizer.eos_id

    @property
    def prefix_token_id(self) -> int:
        return self.run_tokenizer.bos_id

    def tok_encode(
        self, string: str, add_special_tokens: bool | None = None, left_truncate_len: int | None = None, **kwargs
    ) -> list[int]:
        ids = self.run_tokenizer.encode(string)
        if add_special_tokens is not False:
            ids = [self.run_tokenizer.bos_id, *ids]
        return ids[-left_truncate_len:] if left_truncate_len else ids

    def tok_decode(self, tokens: list[int]) -> str:
        return self.run_tokenizer.decode(tokens)

    # -- log-likelihoods ------------------------------------------------------------------------------------------
    def _loglikelihood_tokens(
        self, requests: list[tuple[Any, list[int], list[int]]], disable_tqdm: bool = False, **kwargs
    ) -> list[tuple[float, bool]]:
        mine = self.share.take(requests, lambda req: len(req[1]) + len(req[2]))
        answers = self._score([requests[i] for i in mine])
        return self.share.gather(mine, answers, len(requests))

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        windows, counts = [], []
        for (string,) in (req.args for req in requests):
            token_windows = get_rolling_token_windows(
                # The hf backend's tokens: BOS + text, after the prefix BOS (a tokenizer that adds BOS, as Llama 3's).
                token_list=self.tok_encode(string), prefix_token=self.prefix_token_id,
                max_seq_len=self.max_length, context_len=1,
            )
            rolling = [(None, *make_disjoint_window(window)) for window in token_windows]
            windows += rolling
            counts.append(len(rolling))
        scores = iter(self._loglikelihood_tokens(windows))
        totals = []
        for req, count in zip(requests, counts, strict=True):
            total = sum(logprob for logprob, _ in itertools.islice(scores, count))
            totals.append(total)
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, total)
        return totals

    def _score(self, requests: list[tuple[Any, list[int], list[int]]]) -> list[tuple[float, bool]]:
        """(log-probability, is greedy) of each continuation: the hf backend's `_loglikelihood_tokens`, causal."""
        collator = Collator(
            requests,
            sort_fn=lambda req: (-len(req[1] + req[2]), tuple(req[1] + req[2])),
            group_by="contexts",  # the hf backend's logits cache: one-token continuations of a context scored once
            group_fn=lambda req: req[-2] + req[-1][:-1],
        )
        answers = []
        for chunk in collator.get_batched(n=self.batch_size):
            inputs = [
                torch.tensor((context + continuation)[-(self.max_length + 1):][:-1], dtype=torch.long)
                for _, context, continuation in chunk
            ]
            lengths = [len(row) for row in inputs]  # pad_and_concat pads `inputs` in place
            batch = pad_and_concat(max(lengths), inputs, padding_side="right").to(self._device)
            log_probs = F.log_softmax(self._logits(batch).float(), dim=-1)
            for (key, context, continuation), row_log_probs, length in zip(chunk, log_probs, lengths, strict=True):
                # The continuation's positions: the last len(continuation) of the row's real tokens.
                scored = row_log_probs[length - len(continuation): length].unsqueeze(0)
                greedy = scored.argmax(dim=-1)
                for key, cont_tokens, scored in collator.get_cache(
                    req_str=key, cxt_toks=context, cont_toks=continuation, logits=scored
                ):
                    target = torch.tensor(cont_tokens, dtype=torch.long, device=self._device).unsqueeze(0)
                    is_greedy = bool((greedy[:, -target.shape[1]:] == target).all())
                    logprob = float(torch.gather(scored, 2, target.unsqueeze(-1)).sum())
                    answers.append((logprob, is_greedy))
                    if key is not None:  # rolling windows have no key: their request is cached whole
                        self.cache_hook.add_partial("loglikelihood", key, (logprob, is_greedy))
        self.lockstep.drain()
        return collator.get_original(answers)

    def _logits(self, tokens: torch.Tensor) -> torch.Tensor:
        self.lockstep.before_forward()
        with torch.no_grad():
            return full_logits(self.model(tokens))

    # -- generation -----------------------------------------------------------------------------------------------
    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        args = [req.args for req in requests]
        mine = self.share.take(args, lambda arg: len(self.tok_encode(arg[0])))
        texts = self._generate([args[i] for i in mine])
        for arg, text in zip((args[i] for i in mine), texts, strict=True):
            self.cache_hook.add_partial("generate_until", arg, text)
        return self.share.gather(mine, texts, len(args))

    def _generate(self, args: list[tuple[str, dict]]) -> list[str]:
        collator = Collator(
            args, sort_fn=lambda arg: (-len(self.tok_encode(arg[0])), arg[0]), group_by="gen_kwargs",
            group_fn=lambda arg: arg[1],
        )
        texts = []
        stepped = LockstepModel(self.model, self.lockstep)
        for chunk in collator.get_batched(n=self.batch_size):
            contexts, all_kwargs = zip(*chunk, strict=True)
            kwargs = normalize_gen_kwargs(all_kwargs[0], self.max_gen_toks)
            until = handle_stop_sequences(kwargs.pop("until", None), eos=None)
            max_gen_toks = kwargs.pop("max_gen_toks")
            if max_gen_toks >= self.max_length:
                raise ConfigError(
                    f"a task asks for max_gen_toks {max_gen_toks}, not below the model's context {self.max_length}"
                )
            sampling = _sampling(kwargs)
            generator = torch.Generator(self._device).manual_seed(self.seed)
            max_context = self.max_length - max_gen_toks  # the hf backend's left truncation
            encoded = [self.tok_encode(context, left_truncate_len=max_context) for context in contexts]
            new_tokens: list[list[int]] = [[] for _ in encoded]
            # Rows of one length go together: no padding, so each row decodes as it would alone.
            by_length = itertools.groupby(sorted(range(len(encoded)), key=lambda i: len(encoded[i])),
                                          key=lambda i: len(encoded[i]))
            for _, rows in by_length:
                rows = list(rows)
                prompt = torch.tensor([encoded[i] for i in rows], dtype=torch.long, device=self._device)
                generated = generate(
                    stepped, prompt, max_gen_toks, sampling, self.eos_ids, generator, self.run_tokenizer.vocab_size
                )
                for i, ids in zip(rows, generated.tolist(), strict=True):
                    new_tokens[i] = ids
            texts += [postprocess_generated_text(self.tok_decode(ids), until, None) for ids in new_tokens]
        self.lockstep.drain()
        return collator.get_original(texts)


def _sampling(kwargs: dict) -> Sampling:
    """dtrain's sampling for the harness's normalised generation kwargs: greedy unless do_sample."""
    if not kwargs.get("do_sample"):
        return Sampling()
    return Sampling(float(kwargs.get("temperature") or 1.0), int(kwargs.get("top_k") or 0),
                    float(kwargs.get("top_p") or 1.0))
