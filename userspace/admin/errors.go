package admin

import (
	"encoding/json"
	"errors"
	"net/http"

	"github.com/tether-rl/tether/userspace/registry"
)

// The admin API's error answers: JSON bodies, one status per error kind.

// jsonErrorWriter turns the mux's plain-text error into a JSON one (and
// lets anything else, e.g. a redirect to a clean path, through).
type jsonErrorWriter struct {
	http.ResponseWriter
	done, pass bool
}

func (w *jsonErrorWriter) WriteHeader(code int) {
	if w.done {
		return
	}
	w.done = true
	if code < 400 {
		w.pass = true
		w.ResponseWriter.WriteHeader(code)
		return
	}
	msg := "no such endpoint"
	if code == http.StatusMethodNotAllowed {
		msg = "method not allowed"
	}
	w.ResponseWriter.Header().Del("X-Content-Type-Options")
	writeError(w.ResponseWriter, code, msg)
}

func (w *jsonErrorWriter) Write(p []byte) (int, error) {
	if !w.done {
		w.WriteHeader(http.StatusOK)
	}
	if w.pass {
		return w.ResponseWriter.Write(p)
	}
	return len(p), nil
}

// ErrorBody is the JSON of an error answer.
type ErrorBody struct {
	Error struct {
		Code    int    `json:"code"`
		Message string `json:"message"`
	} `json:"error"`
}

func writeError(w http.ResponseWriter, code int, msg string) {
	var b ErrorBody
	b.Error.Code, b.Error.Message = code, msg
	writeJSON(w, code, b)
}

func writeJSON(w http.ResponseWriter, code int, v any) {
	w.Header().Set("Content-Type", "application/json")
	w.Header().Del("Content-Length")
	w.WriteHeader(code)
	json.NewEncoder(w).Encode(v)
}

// statusOf maps a registry error to an HTTP status.
func statusOf(err error) int {
	switch {
	case errors.Is(err, registry.ErrBadURL):
		return http.StatusBadRequest
	case errors.Is(err, registry.ErrDuplicate), errors.Is(err, registry.ErrFull), errors.Is(err, registry.ErrManaged):
		return http.StatusConflict
	case errors.Is(err, registry.ErrNotFound):
		return http.StatusNotFound
	case errors.Is(err, registry.ErrTooManyPending):
		return http.StatusTooManyRequests
	case errors.Is(err, registry.ErrUnavailable), errors.Is(err, registry.ErrClosed):
		return http.StatusServiceUnavailable
	}
	return http.StatusInternalServerError
}

func (s *Server) fail(w http.ResponseWriter, err error) {
	writeError(w, statusOf(err), err.Error())
}
