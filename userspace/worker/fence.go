package worker

// A fence keeps new work off one worker while the fleet control
// (userspace/fleet) says it must not take any: its weights are being
// updated, or its weight version is not the fleet's. A fenced worker is
// not Healthy to placement (State reports Unhealthy, so keys, sessions
// and keyless requests go elsewhere), and a request that must reach it
// (a w<idx>- session) is held by the fleet until the fence lifts.

// Fence reasons (bits).
const (
	FenceUpdating uint32 = 1 << iota // a weight update call is running on it
	FenceVersion                     // its weight version is not the fleet's target
)

// Fence sets fence bits on the worker.
func (w *Worker) Fence(bits uint32) { w.fence.Or(bits) }

// Unfence clears fence bits on the worker.
func (w *Worker) Unfence(bits uint32) { w.fence.And(^bits) }

// Fenced returns the worker's fence bits (0: none).
func (w *Worker) Fenced() uint32 { return w.fence.Load() }

// BaseState returns the state health checks and drains set, whatever the
// fence.
func (w *Worker) BaseState() State { return State(w.state.Load()) }

// HoldResult is the end of a request's wait in the fleet's hold.
type HoldResult uint8

const (
	HoldReleased HoldResult = iota // route it now
	HoldFull                       // the hold is full: 503, Retry-After
	HoldTimeout                    // held past the pause timeout: 503, Retry-After
	HoldLeft                       // the client left while held
)
