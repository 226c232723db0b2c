"""Per-step output deltas between the engine core process and the server: whatever sequence of
cumulative RequestOutputs the engine produces (growth, a sequence cut back by a stop string, text
rewritten at the end, logprobs on or off, n > 1), the server side rebuilds each one exactly, and the
deltas carry only what changed (no token is sent twice while a sequence grows)."""

from __future__ import annotations

import pickle

from hypothesis import given, settings
from hypothesis import strategies as st

from tallyserve.engine.output_delta import DeltaDecoder, DeltaEncoder
from tallyserve.outputs import CompletionOutput, Logprob, RequestOutput


def _output(rid: str, seqs: list[tuple[list[int], str]], logprobs: bool, finished: bool,
            prompt_lps=None) -> RequestOutput:
    outs = [CompletionOutput(index=i, text=text, token_ids=list(toks), cumulative_logprob=-float(len(toks)),
                             logprobs=[{t: Logprob(-1.0, 1, str(t))} for t in toks] if logprobs else None,
                             finish_reason="length" if finished else None)
            for i, (toks, text) in enumerate(seqs)]
    return RequestOutput(request_id=rid, prompt="p", prompt_token_ids=[1, 2, 3], outputs=outs, finished=finished,
                         num_cached_tokens=2, metrics={"arrival_time": 1.0}, prompt_logprobs=prompt_lps)


# One sequence's life: each step appends tokens, or cuts the list back (a stop string ended it on an
# earlier token); the text may change anywhere at its end (held-back text, a stop string removed).
_step = st.tuples(st.lists(st.integers(0, 1000), max_size=4), st.text(max_size=5), st.integers(0, 3))


@settings(max_examples=150, deadline=None)
@given(steps=st.lists(st.lists(_step, min_size=1, max_size=3), min_size=1, max_size=12), logprobs=st.booleans(),
       n=st.integers(1, 3))
def test_decoder_rebuilds_every_cumulative_output(steps, logprobs, n):
    enc, dec = DeltaEncoder(), DeltaDecoder()
    toks = [[] for _ in range(n)]
    texts = ["" for _ in range(n)]
    for i, step in enumerate(steps):
        for s in range(n):
            new, piece, cut = step[s % len(step)]
            toks[s] = toks[s][:max(0, len(toks[s]) - cut)] if cut else toks[s] + new
            texts[s] = texts[s][:max(0, len(texts[s]) - cut)] + piece
        finished = i == len(steps) - 1
        want = _output("r", [(t, x) for t, x in zip(toks, texts)], logprobs, finished)
        delta = pickle.loads(pickle.dumps(enc.encode(want)))  # as it crosses the pipe
        got = dec.decode(delta)
        assert got == want
    assert len(enc) == len(dec) == 0  # finished requests are forgotten on both sides


def test_growth_sends_only_new_tokens_text_and_logprobs():
    enc = DeltaEncoder()
    enc.encode(_output("r", [([5, 6], "ab")], True, False, prompt_lps=[None, {2: Logprob(-0.5)}]))
    delta = enc.encode(_output("r", [([5, 6, 7], "abc")], True, False, prompt_lps=[None, {2: Logprob(-0.5)}]))
    rid, header, finished, *_rest, prompt_lps, _kv, seqs = delta
    assert rid == "r" and header is None and not finished
    assert prompt_lps is None  # complete once the first token was out: not sent again
    (index, tok_keep, new_tokens, text_keep, text_new, lp_keep, new_lps, *_), = seqs
    assert (index, tok_keep, new_tokens, text_keep, text_new, lp_keep) == (0, 2, [7], 2, "c", 2)
    assert [list(d) for d in new_lps] == [[7]]


def test_an_output_of_a_forgotten_request_is_dropped():
    enc, dec = DeltaEncoder(), DeltaDecoder()
    assert dec.decode(enc.encode(_output("r", [([1], "a")], False, False))).outputs[0].token_ids == [1]
    dec.forget("r")  # its stream went away
    assert dec.decode(enc.encode(_output("r", [([1, 2], "ab")], False, False))) is None
    assert len(dec) == 0


def test_a_rewritten_last_token_is_sent_whole():
    enc, dec = DeltaEncoder(), DeltaDecoder()
    dec.decode(enc.encode(_output("r", [([5, 6], "ab")], False, False)))
    want = _output("r", [([5, 9, 10], "ab")], False, False)  # not a growth of [5, 6]
    assert dec.decode(enc.encode(want)) == want
