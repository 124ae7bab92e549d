package pd

import "sync/atomic"

// Counters count every outcome of Serve.
type Counters struct {
	Requests       atomic.Uint64 // Serve calls
	Served         atomic.Uint64 // D's answer relayed whole (any status D chose)
	Retries        atomic.Uint64 // attempts after the first
	PausedRetries  atomic.Uint64 // ... of them after an attempt a pause failed (not charged)
	PrefillFailed  atomic.Uint64 // P failed or answered 5xx before the client had a byte
	DecodeFailed   atomic.Uint64 // D failed or answered 5xx before the client had a byte
	PrefillRefused atomic.Uint64 // P's 4xx passed to the client
	DecodeRefused  atomic.Uint64 // D's 4xx passed to the client
	GaveUp         atomic.Uint64 // 502 after the last attempt failed
	NoPair         atomic.Uint64 // 503: the chooser had no pair
	BadRequest     atomic.Uint64 // 400: not a JSON object
	RefusedN       atomic.Uint64 // 400: n > 1
	MidStream      atomic.Uint64 // D failed after the client had bytes: the answer ended visibly
	ClientGone     atomic.Uint64 // the client left: both legs cancelled
	LegsCancelled  atomic.Uint64 // legs cancelled (connection closed) by a failure or a departure
	AbortsSent     atomic.Uint64 // abort calls answered 2xx
	AbortsFailed   atomic.Uint64 // abort calls that failed
	LateCancels    atomic.Uint64 // prefills still running PrefillGrace after D ended
	LogprobMerges  atomic.Uint64 // answers or events with P's input logprobs merged in
	Expanded       atomic.Uint64 // requests for n samples served as n requests of one (each counted as a request's outcome)
	MergeFailed    atomic.Uint64 // 502: the samples' answers could not be made one

	MissingKVParams       atomic.Uint64 // a NIXL P answered 2xx without its KV handoff
	PassedWithoutKVParams atomic.Uint64 // ... and D got the body anyway (LetMissingKVParamsThrough)
}

// CounterValues is a snapshot of Counters.
type CounterValues struct {
	Requests, Served, Retries, PausedRetries, PrefillFailed, DecodeFailed, PrefillRefused, DecodeRefused,
	GaveUp, NoPair, BadRequest, RefusedN, MidStream, ClientGone, LegsCancelled,
	AbortsSent, AbortsFailed, LateCancels, LogprobMerges, Expanded, MergeFailed,
	MissingKVParams, PassedWithoutKVParams uint64
}

// Values returns a snapshot (each counter read once, not all at one
// instant).
func (c *Counters) Values() CounterValues {
	return CounterValues{
		Requests: c.Requests.Load(), Served: c.Served.Load(), Retries: c.Retries.Load(), PausedRetries: c.PausedRetries.Load(),
		PrefillFailed: c.PrefillFailed.Load(), DecodeFailed: c.DecodeFailed.Load(),
		PrefillRefused: c.PrefillRefused.Load(), DecodeRefused: c.DecodeRefused.Load(),
		GaveUp: c.GaveUp.Load(), NoPair: c.NoPair.Load(), BadRequest: c.BadRequest.Load(),
		RefusedN: c.RefusedN.Load(), MidStream: c.MidStream.Load(), ClientGone: c.ClientGone.Load(),
		LegsCancelled: c.LegsCancelled.Load(), AbortsSent: c.AbortsSent.Load(),
		AbortsFailed: c.AbortsFailed.Load(), LateCancels: c.LateCancels.Load(),
		LogprobMerges: c.LogprobMerges.Load(), Expanded: c.Expanded.Load(), MergeFailed: c.MergeFailed.Load(),
		MissingKVParams:       c.MissingKVParams.Load(),
		PassedWithoutKVParams: c.PassedWithoutKVParams.Load(),
	}
}
