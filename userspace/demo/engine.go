// Engine control: the abortable requests (generates and streamed chats)
// registered by rid while they run, the abort endpoints that end them, and
// /get_load.

package demo

import (
	"net/http"
	"slices"
	"strconv"
)

// run is one abortable request in flight.
type run struct {
	rid     string
	abort   chan struct{} // closed on abort
	aborted bool          // guarded by Worker.mu
}

func (w *Worker) register(rid string) *run {
	rn := &run{rid: rid, abort: make(chan struct{})}
	w.mu.Lock()
	w.runs[rn] = struct{}{}
	w.mu.Unlock()
	return rn
}

func (w *Worker) unregister(rn *run) {
	w.mu.Lock()
	delete(w.runs, rn)
	w.mu.Unlock()
}

// abortRuns aborts the running requests whose rid is in rids, or all of
// them, and returns the sorted distinct rids it aborted.
func (w *Worker) abortRuns(rids []string, all bool) []string {
	out := []string{}
	w.mu.Lock()
	for rn := range w.runs {
		if rn.aborted || !(all || slices.Contains(rids, rn.rid)) {
			continue
		}
		rn.aborted = true
		close(rn.abort)
		w.aborted = append(w.aborted, rn.rid)
		out = append(out, rn.rid)
	}
	w.mu.Unlock()
	slices.Sort(out)
	return slices.Compact(out)
}

type abortRequest struct {
	Rid        string   `json:"rid"`
	AbortAll   bool     `json:"abort_all"`
	RequestIDs []string `json:"request_ids"`
}

func (w *Worker) abort(rw http.ResponseWriter, r *http.Request) {
	bp := getBuf()
	defer putBuf(bp)
	var req abortRequest
	if _, ok := w.readJSON(rw, r, bp, &req); !ok {
		return
	}
	rids := req.RequestIDs
	if req.Rid != "" {
		rids = append(rids, req.Rid)
	}
	done := w.abortRuns(rids, req.AbortAll)
	b := append((*bp)[:0], `{"aborted":`...)
	b = appendStringList(b, done)
	b = append(b, w.workerField...)
	b = append(b, "}\n"...)
	*bp = b
	w.writeBody(rw, http.StatusOK, b)
}

func (w *Worker) getLoad(rw http.ResponseWriter) {
	bp := getBuf()
	defer putBuf(bp)
	b := append(*bp, `{"worker":`...)
	b = strconv.AppendInt(b, int64(w.opts.Index), 10)
	// Requests in flight other than this probe.
	b = appendIntField(b, "num_reqs", max(w.active.Load()-1, 0))
	b = append(b, `,"num_waiting_reqs":0}`+"\n"...)
	*bp = b
	w.writeBody(rw, http.StatusOK, b)
}
