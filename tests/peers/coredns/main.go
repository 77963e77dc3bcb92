// Command coredns is CoreDNS built with only the plugins the kubelet lab's cluster DNS
// configures (lab/flannelpy_lab/dns.py) and the upstream e2e DNS specs write into their
// Corefiles (forward; hosts and log for the test server agnhost's image carries as
// /coredns), as CoreDNS documents for a build of one's own: its own main, the plugins
// imported, their order set in dnsserver.Directives.
package main

import (
	"github.com/coredns/coredns/core/dnsserver"
	"github.com/coredns/coredns/coremain"

	_ "github.com/coredns/coredns/plugin/cache"
	_ "github.com/coredns/coredns/plugin/errors"
	_ "github.com/coredns/coredns/plugin/forward"
	_ "github.com/coredns/coredns/plugin/health"
	_ "github.com/coredns/coredns/plugin/hosts"
	_ "github.com/coredns/coredns/plugin/kubernetes"
	_ "github.com/coredns/coredns/plugin/loadbalance"
	_ "github.com/coredns/coredns/plugin/log"
	_ "github.com/coredns/coredns/plugin/metrics"
	_ "github.com/coredns/coredns/plugin/ready"
	_ "github.com/coredns/coredns/plugin/reload"
)

// The order of CoreDNS's plugin.cfg (core/dnsserver/zdirectives.go), which is the order a
// query passes through them.
var directives = []string{
	"reload", "ready", "health", "prometheus", "errors", "log", "loadbalance", "cache", "hosts",
	"kubernetes", "forward",
}

func init() {
	dnsserver.Directives = directives
}

func main() {
	coremain.Run()
}
