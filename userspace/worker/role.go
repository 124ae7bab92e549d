package worker

import (
	"fmt"
	"sync/atomic"
)

// Role is a worker's part in a prefill/decode (P/D) disaggregated fleet:
// a regular worker serves whole requests; a prefill and a decode serve one
// request together, as a pair (userspace/pd). The role is given (--prefill,
// --decode, the admin API's worker_type) or learned from the engine
// (dialect.ParseDisaggregation).
type Role int32

const (
	Regular Role = iota
	Prefill
	Decode
)

// DefaultBootstrapPort is an SGLang prefill's bootstrap port when neither
// the URL nor the engine names one.
const DefaultBootstrapPort = 8998

func (r Role) String() string {
	switch r {
	case Regular:
		return "regular"
	case Prefill:
		return "prefill"
	case Decode:
		return "decode"
	}
	return fmt.Sprintf("role(%d)", int32(r))
}

// ParseRole parses "regular" (or ""), "prefill" or "decode".
func ParseRole(s string) (Role, error) {
	switch s {
	case "", "regular":
		return Regular, nil
	case "prefill":
		return Prefill, nil
	case "decode":
		return Decode, nil
	}
	return Regular, fmt.Errorf("worker_type %q: want regular, prefill or decode", s)
}

// Role returns the worker's role.
func (w *Worker) Role() Role { return Role(w.role.Load()) }

// BootstrapPort returns a prefill's bootstrap port (0: unknown, the
// engine's default).
func (w *Worker) BootstrapPort() int { return int(w.bootstrap.Load()) }

// SetRole records the worker's role and, for a prefill, its bootstrap
// port (0: unknown).
func (w *Worker) SetRole(r Role, bootstrapPort int) {
	w.bootstrap.Store(int32(bootstrapPort))
	if Role(w.role.Swap(int32(r))) != r {
		roleChanges.Add(1)
	}
}

// roleChanges counts the role changes of every worker (RoleChanges).
var roleChanges atomic.Uint64

// RoleChanges counts every change of any worker's role: with the table's
// Epoch it says when a view of the fleet's roles must be made again.
func RoleChanges() uint64 { return roleChanges.Load() }
