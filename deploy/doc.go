// Package deploy holds what an operator deploys next to tetherd: the
// Grafana dashboard (grafana/tether.json) and the Prometheus alerting
// rules (prometheus/tether-rules.yml, with their promtool unit tests).
// Its tests check them against a real Prometheus scraping a running
// tetherd in front of fake engines under load, and check the live page
// (GET /ui) in a real browser (headless Chromium).
package deploy
