package upstream

// Attempt is what is known of an upstream connection that failed before
// any response came: what the retry rule (Retry) reads, on every path
// (Pool.Get's connect, the goroutine path's first write, an event loop's
// own sockets).
type Attempt struct {
	Sent      bool // a byte of the request went up on it
	Reused    bool // it had served an earlier request (it may have died while idle)
	Connected bool // its connect had succeeded
	Retried   bool // the request's one retry was made already
	Local     bool // the connect failed for want of this host's resources (ErrLocal), or was cancelled
}

// Retry is the one retry rule: a request gets at most one new connection,
// and only while not one byte of it went up (docs/http-framing.md rule
// 25): after a reused connection that died before its first byte
// (RetryDeadPooled), or after a connect that failed (RetryConnect); never
// for this host's own shortage, which no new connect would cure. The
// reason is what the retry counts under (Pool.Retries).
func (a Attempt) Retry() (reason int, ok bool) {
	switch {
	case a.Sent || a.Retried || a.Local:
		return 0, false
	case a.Reused:
		return RetryDeadPooled, true
	case !a.Connected:
		return RetryConnect, true
	}
	return 0, false
}
