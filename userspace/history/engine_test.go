package history_test

import (
	"net/http"
	"testing"

	"github.com/tether-rl/tether/userspace/engine"
	"github.com/tether-rl/tether/userspace/fleet"
	"github.com/tether-rl/tether/userspace/history"
	"github.com/tether-rl/tether/userspace/worker"
)

// Every path history.Kind names a sync step is one tetherd's engine
// endpoints serve (so the timeline cannot drift from them), and the
// engine's other endpoints are not steps.
func TestKindsAreEngineEndpoints(t *testing.T) {
	tab := worker.NewTable()
	e := engine.New(engine.Config{Table: tab, Fleet: fleet.New(fleet.Config{Table: tab})})
	steps := []string{"/pause_generation", "/pause", "/continue_generation", "/resume", "/update_weights_from_disk",
		"/update_weights_from_distributed", "/update_weights_from_tensor", "/update_weights_from_ipc", "/init_weights_update_group",
		"/destroy_weights_update_group", "/update_weight_version", "/post_process_weights", "/init_weight_transfer_engine",
		"/start_weight_update", "/update_weights", "/finish_weight_update", "/release_memory_occupation",
		"/resume_memory_occupation", "/sleep", "/wake_up", "/reset_prefix_cache"}
	for _, p := range steps {
		if history.Kind([]byte(p)) == "" {
			t.Errorf("%s: not a step", p)
		}
		if e.Local([]byte(http.MethodPost), []byte(p)) == nil {
			t.Errorf("%s: a step the engine endpoints do not serve", p)
		}
	}
	for _, p := range []string{"/abort_request", "/get_loads", "/is_paused", "/get_weight_version", "/fleet", "/flush_cache"} {
		if history.Kind([]byte(p)) != "" {
			t.Errorf("%s: taken for a sync step", p)
		}
	}
}
