package daemon

// Giving memory back after a crowd leaves. 10,000 keep-alive connections
// that come and go leave their heap pages free but mapped: the Go runtime
// returns them only as its background scavenger gets to them, and runs no
// collection while nothing allocates. When the open connections fall by
// at least trimDrop and to half their peak or less, tetherd collects and
// returns what is free at once (debug.FreeOSMemory: one collection, a few
// milliseconds of one core with a small heap), at most once per fall.

import (
	"runtime/debug"
	"time"
)

const (
	trimDrop  = 2000
	trimEvery = time.Second
)

// trimmer tracks the peak of open connections since the last trim.
type trimmer struct{ peak int64 }

// observe takes the open connection count and reports whether to trim now.
func (t *trimmer) observe(open int64) bool {
	if open > t.peak {
		t.peak = open
	}
	if t.peak-open >= trimDrop && open <= t.peak/2 {
		t.peak = open
		return true
	}
	return false
}

// startTrim watches the open connections until stop closes.
func (d *Daemon) startTrim(stop <-chan struct{}) {
	if d.Proxy == nil {
		return
	}
	open := &d.Proxy.Counters().Open
	d.wg.Add(1)
	go func() {
		defer d.wg.Done()
		tk := time.NewTicker(trimEvery)
		defer tk.Stop()
		var t trimmer
		for {
			select {
			case <-stop:
				return
			case <-tk.C:
				if t.observe(open.Load()) {
					debug.FreeOSMemory()
				}
			}
		}
	}()
}
