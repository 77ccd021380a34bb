// API keys: constant-time comparison, the key file, a missing vs a wrong key, the open health
// route, and the refusal to start without keys unless told to run open on loopback.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>

#include "keel/serve/auth.h"
#include "keel/serve/server.h"
#include "tests/serve/serve_process.h"
#include "tests/support/check.h"

namespace keel::test {
namespace {

std::string write_keys(const std::string& dir, const std::string& text) {
  const std::string path = dir + "/keys";
  std::ofstream(path) << text;
  return path;
}

TEST(ServeAuth, ConstantTimeEqualComparesWholeStrings) {
  EXPECT_TRUE(serve::constant_time_equal("abc", "abc"));
  EXPECT_FALSE(serve::constant_time_equal("abc", "abd"));
  EXPECT_FALSE(serve::constant_time_equal("abc", "abcd"));  // a prefix is not the key
  EXPECT_FALSE(serve::constant_time_equal("", "a"));
  EXPECT_TRUE(serve::constant_time_equal("", ""));
}

TEST(ServeAuth, KeyFileHoldsSeveralKeysCommentsAndBlankLines) {
  const std::string dir = temp_dir("serve-keys");
  auto keys = serve::ApiKeys::load(
      write_keys(dir, "# team keys\n alpha-key-0123456789 \n\nbeta-key-0123456789\r\n"));
  EXPECT_EQ(keys.size(), 2u);
  EXPECT_EQ(keys.check("Bearer alpha-key-0123456789"), 200);
  EXPECT_EQ(keys.check("Bearer beta-key-0123456789"), 200);
  EXPECT_EQ(keys.check("Bearer gamma-key-0123456789"), 403);
  EXPECT_EQ(keys.check("Bearer alpha-key-012345678"), 403);
  EXPECT_EQ(keys.check(""), 401);
  EXPECT_EQ(keys.check("alpha-key-0123456789"), 401);
  EXPECT_EQ(keys.check("Basic YWxwaGE6"), 401);
  EXPECT_EQ(keys.check("Bearer "), 401);
  // The scheme is case-insensitive, and spaces may follow it (RFC 9110 11.1, 11.4): these were 401.
  EXPECT_EQ(keys.check("bearer alpha-key-0123456789"), 200);
  EXPECT_EQ(keys.check("BEARER alpha-key-0123456789"), 200);
  EXPECT_EQ(keys.check("Bearer   alpha-key-0123456789"), 200);
  EXPECT_EQ(keys.check("bearer gamma-key-0123456789"), 403);
  EXPECT_EQ(keys.check("Bearer  "), 401);
  EXPECT_EQ(keys.check("Bearerx alpha-key-0123456789"), 401);
  EXPECT_EQ(keys.check("Bearer"), 401);
  EXPECT_CONTAINS(error_of([&] { serve::ApiKeys::load(dir + "/missing"); }), dir + "/missing");
  EXPECT_CONTAINS(error_of([&] { serve::ApiKeys::load(write_keys(dir, "# none\n\n")); }),
                  "holds no key");
  // A short key is refused naming its line: nothing limits how often a client may guess.
  EXPECT_CONTAINS(
      error_of([&] { serve::ApiKeys::load(write_keys(dir, "# ok\nalpha-key-0123456789\nkey\n")); }),
      "the key on line 3 has 3 characters; use at least 16");
  // A directory is not a key file (it read as one holding no key).
  EXPECT_CONTAINS(error_of([&] { serve::ApiKeys::load(dir); }),
                  "cannot read the API key file " + dir);
}

TEST(ServeAuth, LoopbackHosts) {
  EXPECT_TRUE(serve::is_loopback_host("127.0.0.1"));
  EXPECT_TRUE(serve::is_loopback_host("127.1.2.3"));
  EXPECT_TRUE(serve::is_loopback_host("::1"));
  EXPECT_TRUE(serve::is_loopback_host("localhost"));
  EXPECT_FALSE(serve::is_loopback_host("0.0.0.0"));
  EXPECT_FALSE(serve::is_loopback_host("10.0.0.1"));
}

TEST(ServeAuth, RoutesNeedABearerKeyButHealthIsOpen) {
  const std::string dir = temp_dir("serve-auth");
  ServeProcess srv({"--root", dir + "/root", "--api-key-file",
                    write_keys(dir, "key-one-0123456789\nkey-two-0123456789\n")});
  ASSERT_TRUE(srv.started()) << srv.output();
  EXPECT_CONTAINS(srv.output(), "2 API keys");
  Api none{srv.port(), ""}, wrong{srv.port(), "key-three-0123456789"},
      right{srv.port(), "key-two-0123456789"};
  auto health = none.get("/health");
  ASSERT_TRUE(health);
  EXPECT_EQ(health->status, 200);
  auto r = none.get("/v1/runs");
  ASSERT_TRUE(r);
  EXPECT_EQ(r->status, 401);
  EXPECT_EQ(r->get_header_value("WWW-Authenticate"), "Bearer");
  EXPECT_CONTAINS(r->body, "Authorization: Bearer KEY");
  r = none.get("/v1/runs", {{"Authorization", "Token key-two-0123456789"}});
  ASSERT_TRUE(r);
  EXPECT_EQ(r->status, 401);
  // A wrong key is 401 invalid_api_key, as OpenAI answers it (403 read as permission denied).
  r = wrong.get("/v1/runs");
  ASSERT_TRUE(r);
  EXPECT_EQ(r->status, 401);
  EXPECT_EQ(r->get_header_value("WWW-Authenticate"), "Bearer error=\"invalid_token\"");
  EXPECT_CONTAINS(r->body, "not valid");
  EXPECT_CONTAINS(r->body, "\"type\":\"authentication_error\"");
  EXPECT_CONTAINS(r->body, "\"code\":\"invalid_api_key\"");
  r = wrong.post("/v1/runs", tiny_config(5).dump());
  ASSERT_TRUE(r);
  EXPECT_EQ(r->status, 401);
  r = right.get("/v1/runs");
  ASSERT_TRUE(r);
  EXPECT_EQ(r->status, 200);
  EXPECT_EQ(nlohmann::json::parse(r->body)["data"].size(), 0u);
  // An unknown route behind the key is a JSON 404, not an empty page.
  r = right.get("/v1/nothing");
  ASSERT_TRUE(r);
  EXPECT_EQ(r->status, 404);
  EXPECT_CONTAINS(r->body, "no route");
  EXPECT_EQ(srv.stop(), 0);
}

TEST(ServeAuth, RefusesToStartWithoutKeysUnlessOpenOnLoopback) {
  const std::string dir = temp_dir("serve-open");
  auto [code, out] = serve_refusal({"--root", dir + "/root"});
  EXPECT_EQ(code, 2);
  EXPECT_CONTAINS(out, "--api-key-file");
  std::tie(code, out) = serve_refusal({"--root", dir + "/root", "--api-key-file", dir + "/nope"});
  EXPECT_EQ(code, 2);
  EXPECT_CONTAINS(out, dir + "/nope");
  // A root that is a file, and a body limit no request fits: refused naming the flag (the file
  // root ended in std::filesystem's own message).
  std::ofstream(dir + "/a-file") << "x";
  std::tie(code, out) = serve_refusal({"--root", dir + "/a-file", "--insecure-open"});
  EXPECT_EQ(code, 2);
  EXPECT_CONTAINS(out, "--root " + dir + "/a-file: cannot create " + dir + "/a-file/runs");
  EXPECT_EQ(out.find("filesystem error"), std::string::npos) << out;
  std::tie(code, out) =
      serve_refusal({"--root", dir + "/root", "--insecure-open", "--max-body-bytes", "0"});
  EXPECT_EQ(code, 2);
  EXPECT_CONTAINS(out, "--max-body-bytes: 0: use a whole number from 1024 to");
  // --insecure-open on an address that is not loopback: refused before listening.
  {
    ServeProcess p({"--root", dir + "/root", "--insecure-open", "--listen", "0.0.0.0:0"});
    EXPECT_FALSE(p.started());
    EXPECT_CONTAINS(p.output(), "loopback");
    EXPECT_EQ(p.stop(), 2);
  }
  ServeProcess open({"--root", dir + "/root", "--insecure-open"});
  ASSERT_TRUE(open.started()) << open.output();
  EXPECT_CONTAINS(open.output(), "OPEN");
  auto r = Api{open.port(), ""}.get("/v1/runs");
  ASSERT_TRUE(r);
  EXPECT_EQ(r->status, 200);
  // A second server on the same root is refused naming the first: its recovery marked the first
  // one's running run interrupted, and the two then reported the run each its own way.
  std::tie(code, out) = serve_refusal({"--root", dir + "/root", "--insecure-open"});
  EXPECT_EQ(code, 2);
  EXPECT_CONTAINS(out, "--root " +
                           std::filesystem::absolute(dir + "/root").lexically_normal().string() +
                           " is in use by another keel serve (pid " + std::to_string(open.pid()));
}

}  // namespace
}  // namespace keel::test
