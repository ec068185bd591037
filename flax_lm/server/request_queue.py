"""Requests decoded together: a bounded queue of requests, and one thread that owns the device and decodes them
in shared batches, reporting each row's text as its tokens come.

Requests that arrive while a batch decodes wait for the next one, which takes as many of them, in order of
arrival, as fit in `batch_size` rows. Each row keeps its own Sampling (flax_lm.generation.sampling), so its text is the
one it would get decoded alone. The batch decodes STEPS_PER_CHUNK steps at a time: between chunks the thread
hands each row's new text on (to a streaming client) and ends the rows that met a stop string or whose client
left.
"""

import collections
import logging
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from flax_lm.generation.sampling import DecodingBatch, Sampling

logger = logging.getLogger(__name__)

# Steps decoded between two looks at the rows: often enough to stream text as it comes, seldom enough that the
# host's work between chunks costs little beside the decoding.
STEPS_PER_CHUNK = 8


@dataclass(frozen=True)
class TextPiece:
    """More text of the prompt `index` of a request, safe to send: no stop string can start in it later."""

    index: int
    text: str


@dataclass(frozen=True)
class RowFinished:
    """The prompt `index` of a request is done: its whole text, its count of new tokens, why it ended ("eos": the
    end-of-text token or a chat model's end of turn, not in the text; "stop": a stop string, cut with what follows it;
    "length": max_new_tokens), and the ids of the new tokens counted (up to the one that ended the text, the token
    that ended it included)."""

    index: int
    text: str
    new_tokens: int
    finish_reason: str
    ids: list[int]


@dataclass(frozen=True)
class Failed:
    """The batch of the request failed (a bug or the device); the server's log has the traceback."""

    message: str


@dataclass
class Completion:
    """One request: the token ids of its prompts, the Sampling of each, and its stop strings. The engine reports
    its progress to `report` (from the decoding thread: it must hand the event over to the thread that waits for
    it); `cancelled`, set from any thread, ends its rows at the next chunk."""

    prompt_ids: list[list[int]]
    samplings: list[Sampling]
    stop: list[str]
    report: Callable[[TextPiece | RowFinished | Failed], None]
    cancelled: bool = False
    prompt_tokens: int = field(init=False)

    def __post_init__(self):
        self.prompt_tokens = sum(map(len, self.prompt_ids))


class RowText:
    """The text of one row as its tokens come: what may be sent so far, and where a stop string ends it."""

    def __init__(self, tokenizer, stop_token_ids: list[int], stop: list[str]):
        self.tokenizer, self.stop_token_ids, self.stop = tokenizer, stop_token_ids, stop
        self.ids: list[int] = []
        self.sent = 0  # characters handed out
        self.result: RowFinished | None = None

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    def stop_position(self, text: str) -> int | None:
        positions = [position for position in map(text.find, self.stop) if position >= 0]
        return min(positions, default=None)

    @staticmethod
    def stop_prefix_length(text: str, stop: str) -> int:
        """The length of the longest end of `text` that begins `stop` (and is shorter than it)."""
        return next(
            (length for length in range(min(len(stop) - 1, len(text)), 0, -1) if text.endswith(stop[:length])), 0
        )

    def add(self, index: int, new_ids: list[int], finished: bool) -> TextPiece | RowFinished | None:
        """Takes the row's new tokens (`finished`: the device decodes no more of them) and returns what to report:
        the text that is now safe to send, or the row's end."""
        known = len(self.ids)
        self.ids += new_ids
        ends_with_eos = finished and bool(self.ids) and self.ids[-1] in self.stop_token_ids
        text = self.decode(self.ids[:-1] if ends_with_eos else self.ids)
        if (position := self.stop_position(text)) is not None:
            # Counted up to the token that completed the stop string, as if decoding had stopped there.
            used = next(
                n
                for n in range(known + 1, len(self.ids) + 1)
                if self.stop_position(self.decode(self.ids[:n])) is not None
            )
            self.result = RowFinished(index, text[:position], used, "stop", self.ids[:used])
        elif finished:
            self.result = RowFinished(index, text, len(self.ids), "eos" if ends_with_eos else "length", self.ids)
        if self.result is not None:
            return self.result
        # Held back: a character still missing some of its bytes, and an end that may begin a stop string.
        safe = len(text.rstrip("\ufffd"))
        safe -= max((self.stop_prefix_length(text[:safe], stop) for stop in self.stop), default=0)
        if safe <= self.sent:
            return None
        piece, self.sent = text[self.sent : safe], safe
        return TextPiece(index, piece)


class BatchingEngine:
    """The queue of requests and the thread that decodes them with `generator` (generate_flax.py's: its sampler,
    parameters, tokenizer and batch_size); see the module docstring. At most `max_queued_requests` wait: `submit`
    refuses more. `metrics` has `batch_rows` (a histogram) and `generated_tokens` (a counter)."""

    def __init__(self, generator, max_queued_requests: int, metrics):
        self.generator, self.max_queued_requests, self.metrics = generator, max_queued_requests, metrics
        self.waiting: collections.deque[Completion] = collections.deque()
        self.condition = threading.Condition()
        self.stopping = False
        self.unanswered = 0  # requests submitted and not yet answered
        self.batch_seconds = 1.0  # of the last batch: what a waiting request is told to wait, per batch ahead
        self.thread = threading.Thread(target=self.decode_batches, name="decoding", daemon=True)

    def start(self):
        self.thread.start()

    def stop(self):
        """Stops the thread once every request submitted is answered."""
        with self.condition:
            self.stopping = True
            self.condition.notify()
        self.thread.join()

    @property
    def queued(self) -> int:
        return len(self.waiting)

    def retry_after_seconds(self) -> int:
        """About when a request refused now would find room: the batches ahead of it, at the last batch's time."""
        batches_ahead = 1 + self.queued / self.generator.batch_size
        return max(1, math.ceil(batches_ahead * self.batch_seconds))

    def submit(self, completion: Completion) -> bool:
        """Queues the request; False, and nothing queued, where max_queued_requests already wait."""
        with self.condition:
            if len(self.waiting) >= self.max_queued_requests:
                return False
            self.waiting.append(completion)
            self.unanswered += 1
            self.condition.notify()
        return True

    def next_batch(self) -> list[Completion] | None:
        """The requests that wait, in order, as many as fit in batch_size rows (those whose client left are
        dropped); None once stopping with none left."""
        with self.condition:
            while True:
                while not self.waiting and not self.stopping:
                    self.condition.wait()
                if not self.waiting:
                    return None
                batch, rows = [], 0
                while self.waiting and rows + len(self.waiting[0].prompt_ids) <= self.generator.batch_size:
                    completion = self.waiting.popleft()
                    if completion.cancelled:
                        self.unanswered -= 1
                        continue
                    batch.append(completion)
                    rows += len(completion.prompt_ids)
                if batch:
                    return batch

    def decode_batches(self):
        while (batch := self.next_batch()) is not None:
            start = time.perf_counter()
            try:
                self.decode(batch)
            except Exception:  # the thread goes on with the next batch
                logger.exception("Failed to decode a batch of %d requests", len(batch))
                for completion in batch:
                    completion.report(Failed("the server failed to answer this request; see its log"))
            self.batch_seconds = time.perf_counter() - start
            with self.condition:
                self.unanswered -= len(batch)

    def decode(self, batch: list[Completion]):
        generator = self.generator
        rows = [(completion, index) for completion in batch for index in range(len(completion.prompt_ids))]
        texts = [RowText(generator.tokenizer, generator.stop_token_ids, completion.stop) for completion, _ in rows]
        decoding = DecodingBatch(
            generator.sampler,
            generator.params,
            [completion.prompt_ids[index] for completion, index in rows],
            [completion.samplings[index] for completion, index in rows],
        )
        self.metrics.batch_rows.observe(len(rows))

        def active_rows() -> list[int]:
            return [row for row, (completion, _) in enumerate(rows) if not (completion.cancelled or texts[row].result)]

        steps = 0  # the first look hands out the first tokens, as soon as the prompts are read
        while active := active_rows():
            new_ids = decoding.advance(steps, ended=sorted(set(range(len(rows))) - set(active)))
            steps = STEPS_PER_CHUNK
            for row in active:
                completion, index = rows[row]
                if event := texts[row].add(index, new_ids[row], bool(decoding.finished[row])):
                    completion.report(event)
                    if isinstance(event, RowFinished):
                        self.metrics.generated_tokens.inc(event.new_tokens)
