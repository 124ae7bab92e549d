package bpf

import (
	"bufio"
	"errors"
	"fmt"
	"os"
	"strings"
	"sync"
	"sync/atomic"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/link"
	"golang.org/x/sys/unix"
)

// Redirect is the local-worker kernel assist of redirect.c (tetherd
// --sockmap=on): the bytes tetherd writes to a worker on this host's
// loopback go straight into the worker's socket, not through the TCP/IP
// stack. It is an experiment, off by default; make bench measures it as
// the tetherd-sockmap target.
type Redirect struct {
	objs redirectObjects
	cg   link.Link

	mu    sync.Mutex
	ports map[uint32]bool // registered in worker_ports

	redirected, direct atomic.Uint64
}

// Cgroup2Mount returns where the cgroup v2 hierarchy is mounted; its root
// cgroup holds every process, worker or tetherd.
func Cgroup2Mount() (string, error) {
	f, err := os.Open("/proc/self/mountinfo")
	if err != nil {
		return "", err
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		// ... mount-point ... - fstype source options
		pre, post, ok := strings.Cut(sc.Text(), " - ")
		fields, typ := strings.Fields(pre), strings.Fields(post)
		if ok && len(fields) >= 5 && len(typ) > 0 && typ[0] == "cgroup2" && fields[3] == "/" {
			return fields[4], nil
		}
	}
	return "", errors.New("no cgroup2 mount (mount one: mount -t cgroup2 none /sys/fs/cgroup/unified)")
}

// OpenRedirect loads redirect.c, attaches its sockops program to the
// cgroup v2 directory cgroup (the hierarchy's root reaches every worker's
// sockets) and its sk_msg program to tetherd's socket map.
func OpenRedirect(cgroup string) (_ *Redirect, err error) {
	r := &Redirect{ports: map[uint32]bool{}}
	if err := loadRedirectObjects(&r.objs, nil); err != nil {
		return nil, fmt.Errorf("load redirect.c: %w", err)
	}
	defer func() {
		if err != nil {
			r.Close()
		}
	}()
	r.cg, err = link.AttachCgroup(link.CgroupOptions{Path: cgroup, Attach: ebpf.AttachCGroupSockOps, Program: r.objs.TetherSockops})
	if err != nil {
		return nil, fmt.Errorf("attach sockops to cgroup %s: %w", cgroup, err)
	}
	err = link.RawAttachProgram(link.RawAttachProgramOptions{Target: r.objs.UpstreamSocks.FD(), Program: r.objs.TetherRedirect, Attach: ebpf.AttachSkMsgVerdict})
	if err != nil {
		return nil, fmt.Errorf("attach sk_msg: %w", err)
	}
	return r, nil
}

// Add puts tetherd's connected upstream socket fd, before its first byte,
// under the sk_msg program, if its peer is a worker socket of this host
// that the sockops program saw (the worker's loopback port is registered
// here on the first connection to it, so that connection and the ones
// before it stay on the stack). It reports whether fd is redirected; a
// socket that is not stays an ordinary one.
func (r *Redirect) Add(fd int) bool {
	ok := r.add(fd)
	if ok {
		r.redirected.Add(1)
	} else {
		r.direct.Add(1)
	}
	return ok
}

func (r *Redirect) add(fd int) bool {
	ls, err1 := unix.Getsockname(fd)
	rs, err2 := unix.Getpeername(fd)
	la, ok1 := ls.(*unix.SockaddrInet4)
	ra, ok2 := rs.(*unix.SockaddrInet4)
	if err1 != nil || err2 != nil || !ok1 || !ok2 || ra.Addr[0] != 127 {
		return false // IPv6, or not on this host's loopback
	}
	port := uint32(ra.Port)
	r.AddPort(port)
	self := redirectTetherSockKey{LocalIp4: ip4(la.Addr), RemoteIp4: ip4(ra.Addr), LocalPort: uint32(la.Port), RemotePort: port}
	peer := redirectTetherSockKey{LocalIp4: self.RemoteIp4, RemoteIp4: self.LocalIp4, LocalPort: self.RemotePort, RemotePort: self.LocalPort}
	var cookie uint64
	if r.objs.WorkerSocks.Lookup(&peer, &cookie) != nil {
		return false
	}
	return r.objs.UpstreamSocks.Update(&self, uint64(fd), ebpf.UpdateNoExist) == nil
}

// AddPort registers a loopback port a worker listens on, so that the
// worker's ends of later connections to it go into worker_socks (Add
// registers the port of each socket it is shown, for the next ones).
func (r *Redirect) AddPort(port uint32) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if !r.ports[port] && r.objs.WorkerPorts.Put(port, uint8(1)) == nil {
		r.ports[port] = true
	}
}

// ip4 is an IPv4 address as the kernel's u32 fields hold it (network byte
// order in memory).
func ip4(a [4]byte) uint32 {
	return uint32(a[0]) | uint32(a[1])<<8 | uint32(a[2])<<16 | uint32(a[3])<<24
}

// Counts returns how many upstream sockets Add redirected and how many it
// left on the stack.
func (r *Redirect) Counts() (redirected, direct uint64) {
	return r.redirected.Load(), r.direct.Load()
}

// Close detaches the programs; sockets already redirected stay so until
// they close (the maps live while they hold sockets).
func (r *Redirect) Close() error {
	var errs []error
	if r.objs.UpstreamSocks != nil && r.objs.TetherRedirect != nil {
		err := link.RawDetachProgram(link.RawDetachProgramOptions{Target: r.objs.UpstreamSocks.FD(), Program: r.objs.TetherRedirect, Attach: ebpf.AttachSkMsgVerdict})
		if err != nil && !errors.Is(err, os.ErrNotExist) {
			errs = append(errs, err)
		}
	}
	if r.cg != nil {
		errs = append(errs, r.cg.Close())
	}
	errs = append(errs, r.objs.Close())
	return errors.Join(errs...)
}
