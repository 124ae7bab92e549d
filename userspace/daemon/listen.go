package daemon

import (
	"context"
	"fmt"
	"log/slog"
	"net"
	"syscall"

	"golang.org/x/sys/unix"

	"github.com/tether-rl/tether/userspace/stats"
)

// openListeners opens k listeners in one SO_REUSEPORT group on addr.
func openListeners(addr string, k int, log *slog.Logger) ([]net.Listener, *stats.Table, error) {
	lc := net.ListenConfig{Control: func(_, _ string, c syscall.RawConn) error {
		var serr error
		err := c.Control(func(fd uintptr) {
			serr = unix.SetsockoptInt(int(fd), unix.SOL_SOCKET, unix.SO_REUSEPORT, 1)
		})
		if err != nil {
			return err
		}
		return serr
	}}
	lc.SetMultipathTCP(false)
	var lns []net.Listener
	for i := 0; i < k; i++ {
		ln, err := lc.Listen(context.Background(), "tcp", addr)
		if err != nil {
			for _, l := range lns {
				l.Close()
			}
			return nil, nil, fmt.Errorf("listen %s: %w", addr, err)
		}
		if i == 0 {
			addr = ln.Addr().String()
		}
		lns = append(lns, ln)
	}
	return lns, stats.NewHeap(), nil
}
