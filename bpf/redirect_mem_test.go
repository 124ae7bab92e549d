package bpf

import (
	"net"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/tether-rl/tether/testenv"
)

func TestRedirectBackpressure(t *testing.T) {
	r, err := OpenRedirect(testenv.Cgroup2(t))
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	lc := net.ListenConfig{}
	lc.SetMultipathTCP(false)
	ln, _ := lc.Listen(t.Context(), "tcp4", "127.0.0.1:0")
	defer ln.Close()
	addr := ln.Addr().(*net.TCPAddr)
	r.AddPort(uint32(addr.Port))
	held := make(chan net.Conn, 4)
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			held <- c
		}
	}()
	for _, redirect := range []bool{false, true} {
		fd := dialFD(t, addr)
		<-held
		if redirect {
			testenv.WaitFor(t, "add", func() bool { return r.add(fd) })
		}
		unix.SetNonblock(fd, true)
		buf := make([]byte, 1<<20)
		total := 0
		deadline := time.Now().Add(3 * time.Second)
		for time.Now().Before(deadline) && total < 1<<30 {
			n, err := unix.Write(fd, buf)
			if n > 0 {
				total += n
				continue
			}
			if err == unix.EAGAIN {
				time.Sleep(10 * time.Millisecond)
				n2, _ := unix.Write(fd, buf)
				if n2 <= 0 {
					break
				}
				total += n2
				continue
			}
			t.Logf("err %v", err)
			break
		}
		t.Logf("redirect=%v: %d KiB accepted before the writer blocked", redirect, total>>10)
	}
}
