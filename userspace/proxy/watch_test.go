package proxy

import (
	"testing"

	"golang.org/x/sys/unix"
)

// The client watch's rule reads a client socket's events, the loop's from
// epoll and a goroutine's from poll: the same bits, the same answer.
func TestWatchSeesLeft(t *testing.T) {
	for _, tc := range []struct {
		name string
		ev   uint32
		left bool
	}{
		{"nothing", 0, false},
		{"bytes of a pipelined request", unix.EPOLLIN, false},
		{"writable", unix.EPOLLOUT, false},
		{"FIN", unix.EPOLLIN | unix.EPOLLRDHUP, true},
		{"FIN behind bytes (poll)", unix.POLLIN | unix.POLLRDHUP, true},
		{"reset", unix.EPOLLIN | unix.EPOLLHUP | unix.EPOLLERR, true},
		{"error (poll)", unix.POLLERR, true},
		{"hang-up (poll)", unix.POLLHUP, true},
	} {
		if got := watchSeesLeft(tc.ev); got != tc.left {
			t.Errorf("%s (%#x): left %v, want %v", tc.name, tc.ev, got, tc.left)
		}
	}
}
