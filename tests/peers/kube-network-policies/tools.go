//go:build tools

package tools

import _ "sigs.k8s.io/kube-network-policies/cmd"
