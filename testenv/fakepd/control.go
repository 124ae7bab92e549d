package fakepd

// The control calls of an RL loop, in both engines' words, on every fake
// P/D engine: pause and resume (SGLang /pause_generation and
// /continue_generation, vLLM /pause and /resume; a pause in abort mode
// ends what runs), a weight update (SGLang /update_weights_from_disk, vLLM
// /update_weights: the body's weight_version, else its model_path, becomes
// the engine's version), the version (GET /get_weight_version), cache
// flushes (/flush_cache, /reset_prefix_cache) and vLLM's
// /abort_requests. WeightVersion and Paused say where an engine is.

import (
	"encoding/json"
	"io"
	"net/http"
	"net/url"
)

// control is an engine's RL-loop state.
type control struct {
	paused  bool
	resumed chan struct{} // closed at the resume (model.go's serving)
	version string
	calls   map[string]int // by path
}

// WeightVersion is the engine's weight version ("" before any update).
func (s *server) WeightVersion() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.ctl.version
}

// Paused reports whether the engine is paused.
func (s *server) Paused() bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.ctl.paused
}

// ControlCalls is how many control calls reached path.
func (s *server) ControlCalls(path string) int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.ctl.calls[path]
}

func (s *server) controlRoutes(mux *http.ServeMux) {
	mux.HandleFunc("POST /pause_generation", s.pause)
	mux.HandleFunc("POST /pause", s.pause)
	mux.HandleFunc("POST /continue_generation", s.resume)
	mux.HandleFunc("POST /resume", s.resume)
	mux.HandleFunc("GET /is_paused", func(w http.ResponseWriter, r *http.Request) {
		writeJSON(w, http.StatusOK, map[string]any{"is_paused": s.Paused()})
	})
	mux.HandleFunc("POST /update_weights_from_disk", s.update)
	mux.HandleFunc("POST /update_weights", s.update)
	mux.HandleFunc("GET /get_weight_version", func(w http.ResponseWriter, r *http.Request) {
		s.count(r.URL.Path)
		writeJSON(w, http.StatusOK, map[string]any{"weight_version": s.WeightVersion()})
	})
	for _, p := range []string{"/flush_cache", "/reset_prefix_cache"} {
		mux.HandleFunc("POST "+p, func(w http.ResponseWriter, r *http.Request) {
			s.count(r.URL.Path)
			writeJSON(w, http.StatusOK, map[string]any{"success": true})
		})
	}
	mux.HandleFunc("POST /abort_requests", func(w http.ResponseWriter, r *http.Request) {
		s.count(r.URL.Path)
		var v struct {
			IDs []string `json:"request_ids"`
		}
		b, _ := io.ReadAll(r.Body)
		json.Unmarshal(b, &v)
		s.mu.Lock()
		for rid, t := range s.rids {
			if len(v.IDs) == 0 || contains(v.IDs, rid) {
				abortLocked(t)
			}
		}
		s.mu.Unlock()
		writeJSON(w, http.StatusOK, map[string]any{})
	})
}

func contains(l []string, s string) bool {
	for _, x := range l {
		if x == s {
			return true
		}
	}
	return false
}

func (s *server) count(path string) {
	s.mu.Lock()
	if s.ctl.calls == nil {
		s.ctl.calls = map[string]int{}
	}
	s.ctl.calls[path]++
	s.mu.Unlock()
}

// pause pauses the engine; in abort mode (SGLang's default, vLLM's
// ?mode=abort) what runs ends.
func (s *server) pause(w http.ResponseWriter, r *http.Request) {
	s.count(r.URL.Path)
	b, _ := io.ReadAll(r.Body)
	mode := r.URL.Query().Get("mode")
	var v struct {
		Mode string `json:"mode"`
	}
	if json.Unmarshal(b, &v) == nil && v.Mode != "" {
		mode = v.Mode
	}
	s.mu.Lock()
	s.ctl.paused = true
	if mode == "" || mode == "abort" {
		for _, t := range s.rids {
			abortLocked(t)
		}
	}
	s.mu.Unlock()
	writeJSON(w, http.StatusOK, map[string]any{"status": "ok", "message": "Generation paused successfully."})
}

func (s *server) resume(w http.ResponseWriter, r *http.Request) {
	s.count(r.URL.Path)
	s.mu.Lock()
	s.ctl.paused = false
	if s.ctl.resumed != nil {
		close(s.ctl.resumed)
		s.ctl.resumed = nil
	}
	s.mu.Unlock()
	writeJSON(w, http.StatusOK, map[string]any{"status": "ok", "message": "Generation continued successfully."})
}

func (s *server) update(w http.ResponseWriter, r *http.Request) {
	s.count(r.URL.Path)
	b, _ := io.ReadAll(r.Body)
	var v struct {
		Version   string `json:"weight_version"`
		ModelPath string `json:"model_path"`
	}
	if err := json.Unmarshal(b, &v); err != nil {
		writeJSON(w, http.StatusBadRequest, map[string]any{"success": false, "message": err.Error()})
		return
	}
	if v.Version == "" {
		v.Version = url.PathEscape(v.ModelPath)
	}
	s.mu.Lock()
	s.ctl.version = v.Version
	s.mu.Unlock()
	writeJSON(w, http.StatusOK, map[string]any{"success": true, "message": "Succeeded to update model weights.", "weight_version": v.Version})
}

// Statistics is the engine's counters.
func (s *server) Statistics() *Stats { return &s.Stats }
