// Package upgrade hands a running tetherd over to a new process without
// dropping a connection (as cloudflare/tableflip does for Go servers): the
// old process starts the binary at its path with its listening sockets and
// the pin-directory lock as inherited, named file descriptors, plus a
// state file (the workers added at run time); the new process takes them
// over, starts serving and says it is ready on a pipe. Only then does the
// old process stop accepting and drain. If the new process exits or stays
// silent, the old one keeps serving.
//
// The sockets are the same kernel objects in both processes, so the
// SO_REUSEPORT group, its BPF program and the connections queued on it
// never go away; the pin-directory flock(2) is held by one open file
// description that both processes share for a moment, so there is no
// window where neither or both own the pins.
package upgrade

import (
	"bufio"
	"errors"
	"fmt"
	"io"
	"os"
	"runtime"
	"strconv"
	"strings"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"github.com/tether-rl/tether/userspace/sysd"
)

// Environment of the new process.
const (
	envNames = "TETHER_UPGRADE_FDS"   // names of fds 3.. separated by ':'
	envReady = "TETHER_UPGRADE_READY" // fd of the readiness pipe
	envFrom  = "TETHER_UPGRADE_FROM"  // pid of the old process
)

// File is a descriptor to hand over, by name.
type File struct {
	Name string
	File *os.File
}

// Inherited is what an old process handed to this one (nil: started
// afresh).
type Inherited struct {
	files map[string]*os.File
	ready *os.File
	From  int // the old process's pid
}

// Inherit returns what the old process passed, or nil when this process
// was not started by an upgrade. The variables are removed from the
// environment so that children do not see them.
func Inherit() (*Inherited, error) {
	names := os.Getenv(envNames)
	readyFD := os.Getenv(envReady)
	from := os.Getenv(envFrom)
	os.Unsetenv(envNames)
	os.Unsetenv(envReady)
	os.Unsetenv(envFrom)
	if readyFD == "" {
		return nil, nil
	}
	in := &Inherited{files: map[string]*os.File{}}
	in.From, _ = strconv.Atoi(from)
	fd, err := strconv.Atoi(readyFD)
	if err != nil || fd < 3 {
		return nil, fmt.Errorf("%s=%q: not a descriptor", envReady, readyFD)
	}
	unix.CloseOnExec(fd)
	in.ready = os.NewFile(uintptr(fd), "upgrade-ready")
	if names != "" {
		for i, name := range strings.Split(names, ":") {
			fd := 3 + i
			unix.CloseOnExec(fd)
			in.files[name] = os.NewFile(uintptr(fd), name)
		}
	}
	return in, nil
}

// Take returns the file handed over as name (nil if none) and forgets it:
// the caller owns it.
func (in *Inherited) Take(name string) *os.File {
	if in == nil {
		return nil
	}
	f := in.files[name]
	delete(in.files, name)
	return f
}

// Ready tells the old process that this one serves: it stops accepting
// and drains. Files not taken are closed.
func (in *Inherited) Ready() error {
	if in == nil || in.ready == nil {
		return nil
	}
	for name, f := range in.files {
		f.Close()
		delete(in.files, name)
	}
	_, err := in.ready.Write([]byte("ready\n"))
	in.ready.Close()
	in.ready = nil
	return err
}

// ErrNotReady: the new process exited, or did not become ready in time.
var ErrNotReady = errors.New("the new process did not become ready")

// Start runs exe with args and the files, and waits up to timeout for it
// to call Ready. On success it returns the running process; otherwise the
// process is killed (if still running) and the error says why. The
// caller keeps its files (the child has its own copies) and closes them.
//
// The process is started with syscall.StartProcess on the raw descriptors:
// os/exec would call File.Fd on each, which makes it blocking, and a
// listening socket's blocking mode is shared with the listener this
// process is still accepting on (see sysd.RawFD).
func Start(exe string, args []string, files []File, stderr *os.File, timeout time.Duration) (*os.Process, error) {
	r, w, err := os.Pipe()
	if err != nil {
		return nil, err
	}
	defer r.Close()
	devnull, err := os.Open(os.DevNull)
	if err != nil {
		w.Close()
		return nil, err
	}
	defer devnull.Close()
	names := make([]string, len(files))
	fds := []uintptr{devnull.Fd(), os.Stdout.Fd(), stderr.Fd()}
	for i, f := range files {
		if strings.Contains(f.Name, ":") {
			w.Close()
			return nil, fmt.Errorf("file name %q contains ':'", f.Name)
		}
		names[i] = f.Name
		fd, err := sysd.RawFD(f.File)
		if err != nil {
			w.Close()
			return nil, fmt.Errorf("%s: %w", f.Name, err)
		}
		fds = append(fds, uintptr(fd))
	}
	fds = append(fds, w.Fd())
	env := append(os.Environ(),
		envNames+"="+strings.Join(names, ":"),
		envReady+"="+strconv.Itoa(3+len(files)),
		envFrom+"="+strconv.Itoa(os.Getpid()))
	pid, err := syscall.ForkExec(exe, append([]string{exe}, args...), &syscall.ProcAttr{Env: env, Files: fds})
	runtime.KeepAlive(files)
	w.Close() // the child has its copy: EOF on r when it exits
	if err != nil {
		return nil, fmt.Errorf("start %s: %w", exe, err)
	}
	proc, err := os.FindProcess(pid)
	if err != nil {
		return nil, err
	}
	exited := make(chan error, 1)
	go func() {
		st, err := proc.Wait()
		if err == nil && !st.Success() {
			err = errors.New(st.String())
		}
		exited <- err
	}()
	ready := make(chan error, 1)
	go func() {
		line, err := bufio.NewReader(r).ReadString('\n')
		if err == nil && line != "ready\n" {
			err = fmt.Errorf("unexpected %q", line)
		}
		ready <- err
	}()
	timer := time.NewTimer(timeout)
	defer timer.Stop()
	select {
	case err := <-ready:
		if err == nil {
			return proc, nil // reaped by the goroutine when it exits
		}
		werr := <-exited
		return nil, fmt.Errorf("%w: it exited (%v)", ErrNotReady, werr)
	case <-timer.C:
		proc.Kill()
		<-exited
		return nil, fmt.Errorf("%w within %v (killed)", ErrNotReady, timeout)
	}
}

// Memfd returns an in-memory file holding data, for handing state over.
func Memfd(name string, data []byte) (*os.File, error) {
	fd, err := unix.MemfdCreate(name, unix.MFD_CLOEXEC)
	if err != nil {
		return nil, fmt.Errorf("memfd: %w", err)
	}
	f := os.NewFile(uintptr(fd), name)
	if _, err := f.Write(data); err != nil {
		f.Close()
		return nil, err
	}
	if _, err := f.Seek(0, io.SeekStart); err != nil {
		f.Close()
		return nil, err
	}
	return f, nil
}

// FromFiles makes an Inherited of sockets passed another way (systemd's
// socket activation or file-descriptor store, sysd.Listeners): Take works
// as for an upgrade; there is no old process to tell (Ready does nothing).
func FromFiles(files map[string]*os.File) *Inherited {
	if len(files) == 0 {
		return nil
	}
	return &Inherited{files: files}
}
