"""Incremental detokenization with stop strings: text deltas, holding back what may still become a stop string."""
from inferno.loader.tokenizer import Tokenizer
from inferno.sampling_params import SamplingParams


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Tokenizer, params: SamplingParams):
        self.stream = tokenizer.decode_stream(skip_special_tokens=params.skip_special_tokens)
        self.tokenizer = tokenizer
        self.stop_strings = params.stop_strings
        self.include_stop = params.include_stop_str_in_output
        self.holdback = max((len(s) for s in self.stop_strings), default=1) - 1
        self.text = ""

    def update(self, token_ids: list[int]) -> str | None:
        """Append the text of new tokens; returns the stop string that ended the text, if any."""
        for token_id in token_ids:
            start = len(self.text)
            delta = self.stream.step(token_id)
            if not delta:
                continue
            self.text += delta
            stop = self._find_stop(start)
            if stop is not None:
                return stop
        return None

    def _find_stop(self, new_text_start: int) -> str | None:
        hits = [(i, stop) for stop in self.stop_strings
                if (i := self.text.find(stop, max(0, new_text_start - len(stop) + 1))) != -1]
        if not hits:
            return None
        i, stop = min(hits)
        self.text = self.text[:i + len(stop)] if self.include_stop else self.text[:i]
        return stop

    def visible_text(self, finished: bool) -> str:
        """Text that can be shown: all of it when finished, otherwise minus a possible stop-string prefix."""
        if finished or not self.stop_strings or self.holdback == 0:
            return self.text
        return self.text[:max(0, len(self.text) - self.holdback)]
