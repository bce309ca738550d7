import java.util.Properties;
import java.util.concurrent.TimeUnit;
import org.apache.kafka.clients.admin.Admin;
import org.apache.kafka.clients.admin.AdminClientConfig;
import org.apache.kafka.clients.admin.DescribeClusterResult;

/**
 * Readiness probe used by scripts/infra.sh: succeeds once the broker answers a real metadata
 * request (describeCluster) with at least one live broker and an active controller.
 * Usage: java -cp 'libs/*' KafkaReady.java BOOTSTRAP TIMEOUT_SECONDS
 */
public class KafkaReady {
  public static void main(String[] args) throws Exception {
    String bootstrap = args[0];
    long deadline = System.nanoTime() + TimeUnit.SECONDS.toNanos(Long.parseLong(args[1]));
    Properties props = new Properties();
    props.put(AdminClientConfig.BOOTSTRAP_SERVERS_CONFIG, bootstrap);
    props.put(AdminClientConfig.REQUEST_TIMEOUT_MS_CONFIG, "2000");
    props.put(AdminClientConfig.DEFAULT_API_TIMEOUT_MS_CONFIG, "3000");
    Exception last = null;
    try (Admin admin = Admin.create(props)) {
      while (System.nanoTime() < deadline) {
        try {
          DescribeClusterResult cluster = admin.describeCluster();
          int brokers = cluster.nodes().get(3, TimeUnit.SECONDS).size();
          if (brokers > 0 && cluster.controller().get(3, TimeUnit.SECONDS) != null) {
            System.out.println("kafka ready: " + brokers + " broker(s) at " + bootstrap);
            return;
          }
        } catch (Exception e) {
          last = e;
        }
        Thread.sleep(300);
      }
    }
    System.err.println("kafka not ready at " + bootstrap + ": " + last);
    System.exit(1);
  }
}
