// Pacing a stream: the pause between two events, cut short by an abort or
// by the client going away, and flushing each event as it is written.

package demo

import (
	"context"
	"net/http"
	"time"
)

// stop says why a stream ended.
type stop int

const (
	stopNone  stop = iota
	stopAbort      // aborted by rid
	stopGone       // client went away
)

// pause waits d, or only polls when d is 0, for an abort or the client going
// away. *tp holds a timer reused across the pauses of one request.
func pause(ctx context.Context, abort <-chan struct{}, tp **time.Timer, d time.Duration) stop {
	if d <= 0 {
		select {
		case <-ctx.Done():
			return stopGone
		case <-abort:
			return stopAbort
		default:
			return stopNone
		}
	}
	if *tp == nil {
		*tp = time.NewTimer(d)
	} else {
		(*tp).Reset(d)
	}
	select {
	case <-(*tp).C:
		return stopNone
	case <-ctx.Done():
		return stopGone
	case <-abort:
		return stopAbort
	}
}

func stopTimer(t *time.Timer) {
	if t != nil {
		t.Stop()
	}
}

// flush flushes rw if it can.
func flush(rw http.ResponseWriter) {
	if f, ok := rw.(http.Flusher); ok {
		f.Flush()
	}
}
