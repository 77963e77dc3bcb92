// Package v20170312 stands in for the Tencent Cloud VPC SDK, which the Go module proxy
// reachable here does not serve. flanneld's tencent-vpc backend links against it; the
// tests never select that backend, so every call fails.
package v20170312

import "errors"

var errUnavailable = errors.New("tencent-vpc backend is not built into this flanneld")

type Filter struct {
	Name   *string
	Values []*string
}

type Route struct {
	DestinationCidrBlock *string
	GatewayType          *string
	GatewayId            *string
	RouteId              *uint64
	RouteType            *string
	Enabled              *bool
}

type RouteTable struct {
	RouteTableId *string
	RouteSet     []*Route
}

type DescribeRouteTablesRequest struct{ Filters []*Filter }
type DescribeRouteTablesResponse struct {
	Response *struct{ RouteTableSet []*RouteTable }
}
type DeleteRoutesRequest struct {
	RouteTableId *string
	Routes       []*Route
}
type CreateRoutesRequest struct {
	RouteTableId *string
	Routes       []*Route
}

type Client struct{}

func NewClientWithSecretId(id, key, region string) (*Client, error) { return &Client{}, errUnavailable }
func NewDescribeRouteTablesRequest() *DescribeRouteTablesRequest    { return &DescribeRouteTablesRequest{} }
func NewDeleteRoutesRequest() *DeleteRoutesRequest                  { return &DeleteRoutesRequest{} }
func NewCreateRoutesRequest() *CreateRoutesRequest                  { return &CreateRoutesRequest{} }

func (c *Client) DescribeRouteTables(*DescribeRouteTablesRequest) (*DescribeRouteTablesResponse, error) {
	return nil, errUnavailable
}
func (c *Client) DeleteRoutes(*DeleteRoutesRequest) (struct{}, error) { return struct{}{}, errUnavailable }
func (c *Client) CreateRoutes(*CreateRoutesRequest) (struct{}, error) { return struct{}{}, errUnavailable }
