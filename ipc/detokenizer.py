from ipc.tokenizer import TokenizerLike


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas, and watches for stop strings.

    A token may end in the middle of a multi-byte UTF-8 character: the decoded text then
    ends with U+FFFD, so that text is held back until the next token completes it.
    Decoding starts a few prompt tokens back (`prefix_offset`) so tokenizers that merge
    or space across a token boundary decode the first output tokens as they would in
    the whole sequence. The text ends before the first stop string found, or after it
    with `include_stop_str`; `stop_reason` is that stop string.
    """

    def __init__(
        self,
        tokenizer: TokenizerLike,
        prompt_token_ids: list[int],
        skip_special_tokens: bool = True,
        stop: list[str] | tuple[str, ...] = (),
        include_stop_str: bool = False,
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.stop = list(stop)
        self.include_stop_str = include_stop_str
        self.max_stop_len = max((len(s) for s in self.stop), default=0)
        context = list(prompt_token_ids[-6:])
        self.token_ids = context
        self.prefix_offset = max(len(context) - 5, 0)
        self.read_offset = len(context)
        self.text = ""
        self.stop_reason: str | None = None

    @property
    def stopped(self) -> bool:
        return self.stop_reason is not None

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
        found = ((self.text.find(s, search_from), n, s) for n, s in enumerate(self.stop))
        hits = [hit for hit in found if hit[0] >= 0]
        if not hits:
            return False
        index, _, stop = min(hits)  # the earliest; at a tie, the first listed
        self.text = self.text[: index + len(stop) * self.include_stop_str]
        self.stop_reason = stop
        return True
