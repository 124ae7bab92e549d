package main

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"hash"
	"io"
	"net"
	"net/http"
	"strings"
	"time"
)

type bodyResult struct {
	transfers int
	bytes     int64
	elapsed   time.Duration
	cpuTicks  int64 // proxy tree CPU during the transfers (0 for direct)
	err       string
	digest    string // sha256 of the first download (cross-target check)
}

func (r bodyResult) mbps() float64 {
	if r.elapsed <= 0 {
		return 0
	}
	return float64(r.bytes) / 1e6 / r.elapsed.Seconds()
}

// cpuPerGB is proxy CPU seconds per 10^9 bytes relayed.
func (r bodyResult) cpuPerGB() float64 {
	if r.bytes == 0 {
		return 0
	}
	return ticksToSeconds(r.cpuTicks) / (float64(r.bytes) / 1e9)
}

func newBodyClient() *http.Client {
	return &http.Client{
		Timeout: 60 * time.Second,
		Transport: &http.Transport{
			Proxy:               nil,
			DialContext:         (&net.Dialer{Timeout: 5 * time.Second}).DialContext,
			MaxIdleConnsPerHost: 4,
			DisableCompression:  true,
			WriteBufferSize:     256 << 10,
			ReadBufferSize:      256 << 10,
		},
	}
}

// bodyRun does sequential keep-alive transfers of payload (upload=true: POST
// to /sha256, checking the digest; upload=false: GET /blob of len(payload)
// bytes) until maxN transfers or maxDur, whichever first (at least 2).
// cpu() samples the proxy's CPU ticks.
func bodyRun(ctx context.Context, base string, ids []string, upload bool, payload []byte, wantSum string,
	maxN int, maxDur time.Duration, cpu func() int64) bodyResult {
	client := newBodyClient()
	defer client.CloseIdleConnections()
	var r bodyResult
	size := int64(len(payload))

	one := func(id string, h hash.Hash) error {
		if upload {
			req, _ := http.NewRequestWithContext(ctx, "POST", fmt.Sprintf("%s/sessions/%s/sha256", base, id), bytes.NewReader(payload))
			req.ContentLength = size
			req.Header.Set("Content-Type", "application/octet-stream")
			resp, err := client.Do(req)
			if err != nil {
				return err
			}
			var sb strings.Builder
			_, err = io.Copy(&sb, io.LimitReader(resp.Body, 64<<10))
			resp.Body.Close()
			if err != nil || resp.StatusCode != 200 {
				return fmt.Errorf("upload status %d: %v %.200s", resp.StatusCode, err, sb.String())
			}
			if !strings.Contains(strings.ToLower(sb.String()), wantSum) {
				return fmt.Errorf("upload digest mismatch: got %.200s", sb.String())
			}
			return nil
		}
		req, _ := http.NewRequestWithContext(ctx, "GET", fmt.Sprintf("%s/sessions/%s/blob?size=%d&seed=1", base, id, size), nil)
		resp, err := client.Do(req)
		if err != nil {
			return err
		}
		var dst io.Writer = io.Discard
		if h != nil {
			dst = h
		}
		n, err := io.Copy(dst, resp.Body)
		resp.Body.Close()
		if err != nil || resp.StatusCode != 200 || n != size {
			return fmt.Errorf("download status %d: got %d of %d bytes: %v", resp.StatusCode, n, size, err)
		}
		return nil
	}

	// One unmeasured transfer opens the keep-alive connection and checks
	// the content (the download is hashed for a cross-target comparison).
	h := sha256.New()
	if err := one(ids[0], h); err != nil {
		r.err = err.Error()
		return r
	}
	if !upload {
		r.digest = hex.EncodeToString(h.Sum(nil))
	}
	c0 := cpu()
	start := time.Now()
	for i := 0; i < maxN; i++ {
		if ctx.Err() != nil {
			r.err = "interrupted"
			break
		}
		if i >= 2 && time.Since(start) >= maxDur {
			break
		}
		if err := one(ids[i%len(ids)], nil); err != nil {
			r.err = err.Error()
			break
		}
		r.transfers++
		r.bytes += size
	}
	r.elapsed = time.Since(start)
	r.cpuTicks = cpu() - c0
	return r
}

// bodySum is the median over runs of one target and direction.
type bodySum struct {
	mbps, cpuPerGB float64
	runs           []float64 // MB/s per run
	transfers      int
	err            string
	digest         string
}

func sumBodies(rs []bodyResult) bodySum {
	var s bodySum
	var cpu []float64
	for _, r := range rs {
		if r.err != "" && s.err == "" {
			s.err = r.err
		}
		if r.digest != "" && s.digest == "" {
			s.digest = r.digest
		}
		if r.bytes == 0 {
			continue
		}
		s.runs = append(s.runs, r.mbps())
		cpu = append(cpu, r.cpuPerGB())
		s.transfers += r.transfers
	}
	s.mbps, s.cpuPerGB = median(s.runs), median(cpu)
	return s
}
