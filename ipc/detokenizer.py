from ipc.tokenizer import TokenizerLike


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas, and watches for stop strings.

    A token may end in the middle of a multi-byte UTF-8 character: the decoded text then
    ends with U+FFFD, so that text is held back until the next token completes it.
    Decoding starts a few prompt tokens back (`prefix_offset`) so tokenizers that merge
    or space across a token boundary decode the first output tokens as they would in
    the whole sequence.
    """

    def __init__(
        self,
        tokenizer: TokenizerLike,
        prompt_token_ids: list[int],
        skip_special_tokens: bool = True,
        stop: list[str] | tuple[str, ...] = (),
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.stop = list(stop)
        self.max_stop_len = max((len(s) for s in self.stop), default=0)
        context = list(prompt_token_ids[-6:])
        self.token_ids = context
        self.prefix_offset = max(len(context) - 5, 0)
        self.read_offset = len(context)
        self.text = ""
        self.stopped = False

    def add_tokens(self, token_ids: list[int]) -> None:
        """Append tokens to `text`, cutting it at a stop string (which sets `stopped`).
        Text that may still begin a stop string is the caller's to hold back."""
        for token_id in token_ids:
            self.token_ids.append(token_id)
            before = len(self.text)
            self.text += self._next_delta()
            if self.stop and self._truncate_at_stop(max(before - self.max_stop_len + 1, 0)):
                break

    def _next_delta(self) -> str:
        skip = self.skip_special_tokens
        prefix = self.tokenizer.decode(
            self.token_ids[self.prefix_offset : self.read_offset], skip_special_tokens=skip
        )
        full = self.tokenizer.decode(self.token_ids[self.prefix_offset :], skip_special_tokens=skip)
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return ""
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.token_ids)
        return full[len(prefix) :]

    def _truncate_at_stop(self, search_from: int) -> bool:
        hits = [i for s in self.stop if (i := self.text.find(s, search_from)) >= 0]
        if not hits:
            return False
        self.text = self.text[: min(hits)]
        self.stopped = True
        return True
