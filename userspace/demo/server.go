package demo

import (
	"context"
	"net"
	"net/http"
	"time"
)

// Server is a Worker served over HTTP/1.1 on its own listener.
type Server struct {
	*Worker
	srv  *http.Server
	ln   net.Listener
	addr string
	done chan struct{} // closed when Serve has returned
}

// Start listens on addr (such as "127.0.0.1:0"; plain TCP, multipath TCP
// off) and serves a new Worker on it in a goroutine.
func Start(addr string, opts Options) (*Server, error) {
	var lc net.ListenConfig
	lc.SetMultipathTCP(false)
	ln, err := lc.Listen(context.Background(), "tcp", addr)
	if err != nil {
		return nil, err
	}
	s := &Server{
		Worker: New(opts),
		ln:     ln,
		addr:   ln.Addr().String(),
		done:   make(chan struct{}),
	}
	s.srv = &http.Server{
		Handler:           s.Worker,
		ReadHeaderTimeout: 30 * time.Second,
		IdleTimeout:       5 * time.Minute,
	}
	go func() {
		defer close(s.done)
		s.srv.Serve(ln) // returns ErrServerClosed on Close/Shutdown
	}()
	return s, nil
}

// Addr returns the listening address, "127.0.0.1:port".
func (s *Server) Addr() string { return s.addr }

// URL returns the base URL, "http://127.0.0.1:port".
func (s *Server) URL() string { return "http://" + s.addr }

// Close closes the listener and every open connection at once, idle or in
// the middle of a request, like a backend dying. Handlers still running see
// their request context cancelled and their writes fail. Close may be called
// more than once.
func (s *Server) Close() error {
	err := s.srv.Close()
	<-s.done
	return err
}

// Shutdown stops accepting, waits for the requests in flight to finish or
// ctx to end, and then closes whatever is left open.
func (s *Server) Shutdown(ctx context.Context) error {
	err := s.srv.Shutdown(ctx)
	if err != nil {
		s.srv.Close()
	}
	<-s.done
	return err
}
