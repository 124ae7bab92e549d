package proxy

import (
	"testing"

	"github.com/tether-rl/tether/userspace/httphead"
)

// The ladder both paths follow (outcome.go): one row per rule.
func TestDecideLadder(t *testing.T) {
	for _, tc := range []struct {
		name   string
		f      fault
		end    ending
		status int
	}{
		{"client left while sending", fault{stage: stageBodyUp, gone: true, timeout: true}, endAbort, 0},
		{"client left mid-body", fault{stage: stageRelay, gone: true}, endAbort, 0},
		{"client's own framing", fault{stage: stageBodyUp, reject: 400}, endReject, 400},
		{"framing beats a timeout", fault{stage: stageBodyUp, reject: 413, timeout: true}, endReject, 413},
		{"early answer", fault{stage: stageBodyUp, answered: true}, endEarly, 0},
		{"stalled body", fault{stage: stageBodyUp, timeout: true}, endReject, 408},
		{"worker stopped taking the body", fault{stage: stageBodyUp}, endGateway, 502},
		{"head write timed out", fault{stage: stageHeadUp, timeout: true}, endGateway, 502},
		{"response timeout", fault{stage: stageWait, timeout: true}, endGateway, 504},
		{"no early answer in time", fault{stage: stageWait, timeout: true, early: true}, endGateway, 502},
		{"worker closed before a head", fault{stage: stageWait}, endGateway, 502},
		{"cut after the head", fault{stage: stageRelay, timeout: true}, endCut, 0},
	} {
		if end, status := decide(tc.f); end != tc.end || status != tc.status {
			t.Errorf("%s: decide = %d, %d; want %d, %d", tc.name, end, status, tc.end, tc.status)
		}
	}
}

func TestInterimPolicy(t *testing.T) {
	for _, tc := range []struct {
		status                  int
		http10, expect, sent100 bool
		want                    interim
	}{
		{101, false, false, false, interimBroken},
		{100, false, true, false, interimRelay},
		{100, false, true, true, interimDrop},
		{100, false, false, false, interimDrop},
		{103, false, false, false, interimRelay},
		{103, true, false, false, interimDrop},
	} {
		if got := interimPolicy(tc.status, tc.http10, tc.expect, tc.sent100); got != tc.want {
			t.Errorf("interimPolicy(%d, http10 %v, expect %v, sent100 %v) = %d, want %d", tc.status, tc.http10, tc.expect, tc.sent100, got, tc.want)
		}
	}
}

// An answer that came before the whole request body went up leaves the
// upstream connection mid-request: it is never reused, whatever the
// answer's framing says, and the client connection closes (the loop used
// to reuse it: the worker would have read the next request as the body).
func TestFrameResponseEarlyAnswerNeverReused(t *testing.T) {
	resp := new(httphead.Response)
	if err := httphead.ParseResponse([]byte("HTTP/1.1 413 Too Large\r\nContent-Length: 0\r\n\r\n"), httphead.Limits{}, resp); err != nil {
		t.Fatal(err)
	}
	if f := frameResponse(resp, false, false, true, true, false); !f.reuse || !f.keep {
		t.Fatalf("whole body sent: %+v, want reuse and keep", f)
	}
	if f := frameResponse(resp, false, false, true, false, false); f.reuse || f.keep {
		t.Fatalf("early answer: %+v, want neither reuse nor keep", f)
	}
}

func TestFrameFirst(t *testing.T) {
	parse := func(h string) *httphead.Response {
		resp := new(httphead.Response)
		if err := httphead.ParseResponse([]byte(h), httphead.Limits{}, resp); err != nil {
			t.Fatal(err)
		}
		return resp
	}
	// More than Content-Length: cut to it, never reuse.
	resp := parse("HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n")
	f := frameResponse(resp, false, false, true, true, false)
	var sc httphead.Chunked
	out, left, extra, err := frameFirst(&f, resp, []byte("hello"), &sc, []byte("H|"))
	if string(out) != "H|he" || left != 0 || !extra || err != nil {
		t.Fatalf("Content-Length: %q %d %v %v", out, left, extra, err)
	}
	// Chunked to an HTTP/1.0 client: the data only.
	resp = parse("HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
	f = frameResponse(resp, false, true, false, true, false)
	if !f.dechunk || !f.closeCut || !f.dropTE || f.keep {
		t.Fatalf("HTTP/1.0 chunked: %+v", f)
	}
	sc = httphead.Chunked{}
	out, _, extra, err = frameFirst(&f, resp, []byte("5\r\nhello\r\n0\r\n\r\nX"), &sc, nil)
	if string(out) != "hello" || !extra || err != nil || !sc.Done() {
		t.Fatalf("dechunked: %q %v %v", out, extra, err)
	}
	// Broken chunk framing: an error (502 before anything went out).
	sc = httphead.Chunked{}
	f = frameResponse(resp, false, false, true, true, false)
	if _, _, _, err := frameFirst(&f, resp, []byte("zz\r\n"), &sc, nil); err == nil {
		t.Fatal("broken chunk size accepted")
	}
}

// The verdicts conclude gives the drivers (outcome.go): one row per
// ending, with what it counts.
func TestConcludeVerdicts(t *testing.T) {
	for _, tc := range []struct {
		name    string
		f       fault
		r       reached
		want    verdict
		counter func(*Counters) uint64
	}{
		{"client left", fault{stage: stageWait, gone: true}, reached{sentUp: true},
			verdict{end: endAbort}, func(c *Counters) uint64 { return c.ClientAborted.Load() }},
		{"stalled body", fault{stage: stageBodyUp, timeout: true}, reached{sentUp: true, unread: true},
			verdict{end: endReject, status: 408, answer: errorResponse(408, true), linger: true}, func(c *Counters) uint64 { return c.Rejected.Load() }},
		{"worker stopped taking the body", fault{stage: stageBodyUp}, reached{sentUp: true, unread: true},
			verdict{end: endGateway, status: 502, answer: upstreamError(502, true, true), failed: true, linger: true}, func(c *Counters) uint64 { return c.BadGateway.Load() }},
		{"response timeout, nothing sent", fault{stage: stageWait, timeout: true}, reached{},
			verdict{end: endGateway, status: 504, answer: upstreamError(504, false, true), failed: true}, func(c *Counters) uint64 { return c.Timeouts.Load() }},
		{"cut of a close-delimited body", fault{stage: stageRelay}, reached{sentUp: true, sentHead: true, closeCut: true},
			verdict{end: endCut, failed: true, reset: true}, func(c *Counters) uint64 { return c.Truncated.Load() }},
		{"early answer", fault{stage: stageBodyUp, answered: true}, reached{sentUp: true, unread: true},
			verdict{end: endEarly}, nil},
	} {
		s := New(Config{})
		v := s.conclude(tc.f, tc.r)
		if v.end != tc.want.end || v.status != tc.want.status || string(v.answer) != string(tc.want.answer) ||
			v.failed != tc.want.failed || v.linger != tc.want.linger || v.reset != tc.want.reset {
			t.Errorf("%s: verdict %+v, want %+v", tc.name, v, tc.want)
		}
		if tc.counter != nil && tc.counter(&s.counters) != 1 {
			t.Errorf("%s: not counted once", tc.name)
		}
	}
	// A gateway failure after the head answers nothing and counts nothing.
	s := New(Config{})
	if v := s.gatewayVerdict(502, reached{sentHead: true, unread: true}); v.answer != nil || v.status != 0 || v.linger || !v.failed {
		t.Errorf("after the head: %+v", v)
	}
	if s.counters.BadGateway.Load() != 0 {
		t.Error("a 502 never answered was counted")
	}
}

// The batching rule (batch.go): raised from batchMin, lowered for the
// last batchLowat bytes, otherwise left.
func TestBatchMark(t *testing.T) {
	for _, tc := range []struct {
		raised bool
		rest   int64
		want   int
	}{
		{false, batchMin, batchLowat},
		{false, batchMin - 1, 0},
		{false, -1, 0},
		{true, batchLowat + 1, 0},
		{true, batchLowat, 1},
		{true, -1, 1}, // a body that ends at the close: no batch to wait for
	} {
		if got := batchMark(tc.raised, tc.rest); got != tc.want {
			t.Errorf("batchMark(%v, %d) = %d, want %d", tc.raised, tc.rest, got, tc.want)
		}
	}
}
