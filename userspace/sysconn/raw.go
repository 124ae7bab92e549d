package sysconn

import (
	"fmt"
	"net"
	"net/netip"
	"os"
	"slices"
	"strconv"
	"strings"
	"unsafe"

	"golang.org/x/sys/unix"
)

// Raw descriptors: an event loop (userspace/proxy/loop.go) owns its
// sockets as plain non-blocking descriptors, outside the Go runtime's
// poller, and lends one to Go's net package only while a goroutine serves
// it.

// DupListener duplicates a listener's descriptor (close-on-exec): the
// caller owns the copy, which stays valid (and the socket open) after the
// listener is closed.
func DupListener(ln *net.TCPListener) (int, error) {
	fd := -1
	err := Control(ln, func(s int) error {
		var err error
		fd, err = unix.FcntlInt(uintptr(s), unix.F_DUPFD_CLOEXEC, 0)
		return err
	})
	return fd, err
}

// TCPConn lends fd to the net package: it returns a *net.TCPConn on a
// duplicate of fd (registered with the runtime's poller); closing it
// closes only the duplicate. fd stays the caller's.
func TCPConn(fd int) (*net.TCPConn, error) {
	d, err := unix.FcntlInt(uintptr(fd), unix.F_DUPFD_CLOEXEC, 0)
	if err != nil {
		return nil, err
	}
	f := os.NewFile(uintptr(d), "")
	nc, err := net.FileConn(f) // dups again; f's copy goes with f
	f.Close()
	if err != nil {
		return nil, err
	}
	tc, ok := nc.(*net.TCPConn)
	if !ok {
		nc.Close()
		return nil, fmt.Errorf("descriptor %d is not a TCP socket", fd)
	}
	return tc, nil
}

// Sockaddr returns the socket address of a numeric "ip:port" (nil for a
// host name, which only the net package's resolver may turn into one).
func Sockaddr(hostport string) unix.Sockaddr {
	ap, err := netip.ParseAddrPort(hostport)
	if err != nil {
		return nil
	}
	a := ap.Addr().Unmap()
	if a.Is4() {
		return &unix.SockaddrInet4{Port: int(ap.Port()), Addr: a.As4()}
	}
	return &unix.SockaddrInet6{Port: int(ap.Port()), Addr: a.As16()}
}

// Accept accepts a connection on the non-blocking listening socket lfd
// (non-blocking, close-on-exec) and returns its peer's address (an IPv4
// address for a v4-mapped one; the zero Addr for a family without one).
// unix.Accept4 costs a getsockopt(SO_PROTOCOL) per connection to build
// its Sockaddr; this reads the address accept4 wrote.
func Accept(lfd int) (int, netip.Addr, error) {
	var rsa unix.RawSockaddrAny
	n := uint32(unix.SizeofSockaddrAny)
	fd, _, e := unix.Syscall6(unix.SYS_ACCEPT4, uintptr(lfd), uintptr(unsafe.Pointer(&rsa)), uintptr(unsafe.Pointer(&n)),
		unix.SOCK_NONBLOCK|unix.SOCK_CLOEXEC, 0, 0)
	if e != 0 {
		return -1, netip.Addr{}, e
	}
	var ip netip.Addr
	switch rsa.Addr.Family {
	case unix.AF_INET:
		a := (*unix.RawSockaddrInet4)(unsafe.Pointer(&rsa))
		ip = netip.AddrFrom4(a.Addr)
	case unix.AF_INET6:
		a := (*unix.RawSockaddrInet6)(unsafe.Pointer(&rsa))
		ip = netip.AddrFrom16(a.Addr).Unmap()
	}
	return int(fd), ip, nil
}

// SocketError returns a socket's pending error (SO_ERROR): how a
// non-blocking connect ended.
func SocketError(fd int) error {
	v, err := unix.GetsockoptInt(fd, unix.SOL_SOCKET, unix.SO_ERROR)
	if err != nil {
		return err
	}
	if v != 0 {
		return unix.Errno(v)
	}
	return nil
}

// Unpoll takes fd out of every epoll set of this process that watches it,
// except those in keep, and returns how many it left. The Go runtime's
// poller registers every socket the net package opens and has no call to
// let one go: a listening socket that an event loop (userspace/proxy)
// accepts on, through its own copy, would otherwise wake the runtime's
// poller thread on every new connection for nothing (bench/measurements.md,
// "The event loop"). The sets are found in /proc/self/fd, the
// watched descriptors in their fdinfo ("tfd:" lines).
func Unpoll(fd int, keep ...int) (int, error) {
	ents, err := os.ReadDir("/proc/self/fd")
	if err != nil {
		return 0, err
	}
	want := "tfd: " + strconv.Itoa(fd) + " "
	left := 0
	for _, e := range ents {
		n, err := strconv.Atoi(e.Name())
		if err != nil || slices.Contains(keep, n) {
			continue
		}
		if t, err := os.Readlink("/proc/self/fd/" + e.Name()); err != nil || t != "anon_inode:[eventpoll]" {
			continue
		}
		info, err := os.ReadFile("/proc/self/fdinfo/" + e.Name())
		if err != nil || !watches(string(info), want) {
			continue
		}
		if err := unix.EpollCtl(n, unix.EPOLL_CTL_DEL, fd, nil); err == nil {
			left++
		}
	}
	return left, nil
}

// watches reports whether an epoll fdinfo lists the target (want: "tfd: N ").
func watches(info, want string) bool {
	for line := range strings.Lines(info) {
		if strings.HasPrefix(strings.Join(strings.Fields(line), " ")+" ", want) {
			return true
		}
	}
	return false
}

// Recv reads from a connected non-blocking socket. It is recvfrom(2)
// without an address, which goes straight to the socket where read(2)
// passes through the VFS layer (file position lock, fsnotify hooks), and a
// raw system call: one that never blocks needs none of the runtime's
// entersyscall/exitsyscall bookkeeping. As unix.Read: -1 and the errno on
// an error, 0 and none at the peer's FIN.
func Recv(fd int, p []byte) (int, error) {
	var ptr unsafe.Pointer
	if len(p) > 0 {
		ptr = unsafe.Pointer(&p[0])
	}
	n, _, e := unix.RawSyscall6(unix.SYS_RECVFROM, uintptr(fd), uintptr(ptr), uintptr(len(p)), 0, 0, 0)
	if e != 0 {
		return -1, e
	}
	return int(n), nil
}

// Send writes to a connected non-blocking socket: sendto(2) without an
// address and with MSG_NOSIGNAL (a closed peer is EPIPE, never a signal),
// as a raw system call (see Recv).
func Send(fd int, p []byte) (int, error) {
	var ptr unsafe.Pointer
	if len(p) > 0 {
		ptr = unsafe.Pointer(&p[0])
	}
	n, _, e := unix.RawSyscall6(unix.SYS_SENDTO, uintptr(fd), uintptr(ptr), uintptr(len(p)), unix.MSG_NOSIGNAL, 0, 0)
	if e != 0 {
		return -1, e
	}
	return int(n), nil
}
