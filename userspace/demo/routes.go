// Routes: ServeHTTP sends each method and path to its endpoint (anything
// else is a 404), and tells a router's GET probes from the requests a test
// looks at (LastHeaders).

package demo

import (
	"net/http"
	"strings"
)

// ServeHTTP implements http.Handler.
func (w *Worker) ServeHTTP(rw http.ResponseWriter, r *http.Request) {
	w.requests.Add(1)
	w.active.Add(1)
	defer w.active.Add(-1)
	rw.Header()["X-Tether-Demo-Worker"] = w.hdrWorker

	path := r.URL.Path
	get, post := r.Method == http.MethodGet, r.Method == http.MethodPost
	if !get || !probePath(path) {
		// The server never modifies a request's headers once the handler
		// runs, so keeping a pointer is safe; LastHeaders copies.
		w.last.Store(&r.Header)
	}

	switch path {
	case "/health":
		if get {
			w.writeBody(rw, http.StatusOK, w.health)
			return
		}
	case "/sessions":
		if post {
			w.createSession(rw)
			return
		}
	case "/v1/chat/completions":
		if post {
			w.chat(rw, r, "", false)
			return
		}
	case "/generate":
		if post {
			w.generate(rw, r)
			return
		}
	case "/abort_request", "/abort_requests":
		if post {
			w.abort(rw, r)
			return
		}
	case "/flush_cache":
		if post || get {
			w.writeBody(rw, http.StatusOK, w.flushed)
			return
		}
	case "/get_load":
		if get {
			w.getLoad(rw)
			return
		}
	default:
		rest, ok := strings.CutPrefix(path, "/sessions/")
		if !ok {
			break
		}
		id, sub, _ := strings.Cut(rest, "/")
		if id == "" {
			break
		}
		switch {
		case sub == "" && get:
			w.getSession(rw, id)
			return
		case sub == "" && r.Method == http.MethodDelete:
			w.deleteSession(rw, id)
			return
		case sub == "v1/chat/completions" && post:
			w.chat(rw, r, id, true)
			return
		case sub == "echo" && post:
			w.echo(rw, r)
			return
		case sub == "sha256" && post:
			w.sha256(rw, r)
			return
		case sub == "blob" && get:
			w.blob(rw, r)
			return
		case sub == "slow" && post:
			w.slow(rw, r)
			return
		}
	}
	w.writeError(rw, http.StatusNotFound, "not_found_error", "no route for "+r.Method+" "+path)
}

// probePath reports whether a GET of path is a router's control-plane
// probe (health checks, load polling), not a request a test looks at.
func probePath(path string) bool {
	switch path {
	case "/health", "/get_load", "/v1/loads", "/metrics", "/get_weight_version":
		return true
	}
	return false
}
